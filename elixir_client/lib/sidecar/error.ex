defmodule Sidecar.Error do
  @moduledoc """
  Every failure is returned as `{:error, %Sidecar.Error{}}`.

  `reason` is an atom: the sidecar's error code (see `protocol/PROTOCOL.md`) or one of the
  client's own. A code this client does not know yet is `:unknown`.

  The sidecar's codes:

    * framing and envelope: `:frame_too_large`, `:invalid_msgpack`, `:invalid_message`,
      `:invalid_id`, `:unknown_op`, `:invalid_params`, `:duplicate_id`, `:too_many_requests`
    * `:limit_exceeded` - a request over one of the sidecar's limits; `details` carry `"limit"` (its
      name, such as `"max_prompt_bytes"`), `"max"` and `"value"`
    * `:forbidden` - refused by how the sidecar was started (remote code, a path outside its model
      roots, saving or restoring sessions without a `:session_dir`)
    * sessions and models: `:unknown_session`, `:session_exists`, `:session_closed`,
      `:session_busy`, `:unknown_model`, `:model_exists`
    * `load_model` failures: `:model_not_found`, `:invalid_model` (config or weights unreadable),
      `:not_causal_lm`, `:no_tokenizer`, `:remote_code_required`, `:unknown_device` (a device torch
      does not know or this machine does not have; `details["available"]` lists the ones it has)
    * rejected `generate` input: `:invalid_argument` (`details["option"]` names the option),
      `:empty_input`, `:token_out_of_range`, `:context_overflow`, `:unknown_strategy`,
      `:invalid_processor`, `:no_chat_template` (messages for a model whose tokenizer has no chat
      template), `:sample_mismatch` (a `{:continue, sequence: i}` past the last result's sequences;
      `details["sequences"]` says how many it has)
    * `:cache_budget_exceeded` - the generation (or a fork or restore) needs more KV memory than the
      sidecar's cache budget even with every idle cache evicted; `details` carry `"limit"`, `"max"`
      and `"value"` (bytes)
    * `:invalid_logits` - the processors left no token to sample from at some step
    * `:invalid_session_file` - `Sidecar.restore_session/3`: no session saved under that name, or a
      file that cannot be restored here (saved from another model or dtype, truncated, corrupted)
    * `:save_failed` - `Sidecar.save_session/4` could not write the file (disk full, directory not
      writable); nothing was left behind
    * `:cancelled` - the generation was cancelled; `details` carry its partial `"text"`,
      `"token_ids"` and `"stats"`, and the rest of a result as the sidecar sent it (`"sequences"`,
      the log-probabilities asked for, as lists); one cancelled before the client sent it, only
      those three and `"finish_reason"`
    * `:internal` - a defect in the sidecar

  The client's own: `:sidecar_exited` (the Python process died while the call was in flight),
  `:session_lost` (the session belonged to a sidecar that has since died), `:owner_exited` (a session's
  `owner:` had exited before the call that would make the session), `:timeout`,
  `:not_running` (no connection under that name, or one still starting that did not answer in time).
  `:invalid_argument` and `:frame_too_large` also come from the client, for a request it cannot send
  (a value msgpack cannot carry, named by `details["param"]`; a frame over the sidecar's
  `max_frame_bytes`). `details` keeps whatever
  else the sidecar sent.

  A start that fails (`Sidecar.start_link/1`) is `:sidecar_exited` or `:timeout`. Its message ends
  with the line of the sidecar's stderr that names the cause (a bad flag, a model that does not
  load, a `:python` without the sidecar installed, with how to fix that one); `details` carry
  `:status` (the exit status) and `:stderr`, the last lines the sidecar printed, as one string.
  """

  defexception [:reason, :message, details: %{}]

  @type t :: %__MODULE__{reason: atom(), message: String.t(), details: map()}

  @server_codes ~w(frame_too_large invalid_msgpack invalid_message invalid_id unknown_op invalid_params
    duplicate_id limit_exceeded forbidden unknown_session session_exists unknown_model model_exists
    invalid_model cancelled too_many_requests internal model_not_found not_causal_lm no_tokenizer
    remote_code_required invalid_argument empty_input token_out_of_range context_overflow
    unknown_strategy session_closed session_busy invalid_processor invalid_logits no_chat_template
    cache_budget_exceeded unknown_device invalid_session_file save_failed sample_mismatch)

  @doc false
  @spec from_reply(term()) :: t()
  def from_reply(error) when is_map(error) do
    code = error["code"]
    reason = if code in @server_codes, do: String.to_atom(code), else: :unknown

    message =
      case error["message"] do
        message when is_binary(message) -> message
        _ -> "the sidecar's error carried no message (code #{inspect(code, limit: 5)})"
      end

    %__MODULE__{reason: reason, message: message, details: Map.drop(error, ["code", "message"])}
  end

  # A sidecar that breaks the protocol fails the one request, not the connection.
  def from_reply(error) do
    %__MODULE__{
      reason: :unknown,
      message: "the sidecar's error is not a map: #{inspect(error, limit: 10)}",
      details: %{}
    }
  end

  @doc false
  @spec new(atom(), String.t(), map()) :: t()
  def new(reason, message, details \\ %{}),
    do: %__MODULE__{reason: reason, message: message, details: details}
end
