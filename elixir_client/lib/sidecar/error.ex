defmodule Sidecar.Error do
  @moduledoc """
  Every failure is returned as `{:error, %Sidecar.Error{}}`.

  `reason` is an atom: the sidecar's error code (`:context_overflow`, `:unknown_session`,
  `:invalid_processor`, `:cancelled`, ... see `protocol/PROTOCOL.md`) or one of the client's own:
  `:sidecar_exited` (the Python process died while the call was in flight), `:session_lost` (the
  session belonged to a sidecar that has since died), `:timeout`, `:not_running`. `details` keeps
  whatever else the sidecar sent, such as the partial `token_ids` of a cancelled generation.
  """

  defexception [:reason, :message, details: %{}]

  @type t :: %__MODULE__{reason: atom(), message: String.t(), details: map()}

  @server_codes ~w(frame_too_large invalid_msgpack invalid_message invalid_id unknown_op invalid_params
    duplicate_id unknown_session session_exists unknown_model model_exists cancelled
    too_many_requests internal model_not_found not_causal_lm no_tokenizer remote_code_required
    invalid_argument empty_input token_out_of_range context_overflow unknown_strategy session_closed
    session_busy invalid_processor)

  @doc false
  @spec from_reply(map()) :: t()
  def from_reply(%{"code" => code, "message" => message} = error) do
    reason = if code in @server_codes, do: String.to_atom(code), else: :unknown
    %__MODULE__{reason: reason, message: message, details: Map.drop(error, ["code", "message"])}
  end

  @doc false
  @spec new(atom(), String.t(), map()) :: t()
  def new(reason, message, details \\ %{}),
    do: %__MODULE__{reason: reason, message: message, details: details}
end
