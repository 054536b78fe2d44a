defmodule Sidecar.Processors do
  @moduledoc """
  Logits-processor configs, one struct per built-in processor of the sidecar, mirroring Bumblebee.

      top_k = Sidecar.configure(Sidecar.Processors.TopK, k: 50)
      Sidecar.generate(session, "Once upon", processors: [top_k])

  Options without a default are required. An unknown option raises `ArgumentError`, as
  `Bumblebee.configure/2` does. Values are range-checked by the sidecar, which is the single authority
  on their meaning; a bad value comes back as `{:error, %Sidecar.Error{reason: :invalid_processor}}`.
  """

  # {module, protocol name, [{option, default}]}; :required marks options without a default.
  @declarations [
    {Temperature, "temperature", [temperature: :required]},
    {TopK, "top_k", [k: :required, min_tokens_to_keep: 1]},
    {TopP, "top_p", [p: :required, min_tokens_to_keep: 1]},
    {MinP, "min_p", [p: :required, min_tokens_to_keep: 1]},
    {TypicalP, "typical_p", [p: :required, min_tokens_to_keep: 1]},
    {RepetitionPenalty, "repetition_penalty", [penalty: :required, prompt_ignore_length: nil]},
    {FrequencyPenalty, "frequency_penalty", [penalty: :required]},
    {PresencePenalty, "presence_penalty", [penalty: :required]},
    {NoRepeatNGram, "no_repeat_ngram", [ngram_size: :required]},
    {MinLength, "min_length", [min_length: :required, eos_token_ids: :required]},
    {MinNewTokens, "min_new_tokens", [min_new_tokens: :required, eos_token_ids: :required]},
    {SuppressTokens, "suppress_tokens", [token_ids: :required]},
    {SuppressTokensAtBegin, "suppress_tokens_at_begin", [token_ids: :required, begin_index: nil]},
    {ForcedBOS, "forced_bos", [token_id: :required]},
    {ForcedEOS, "forced_eos", [max_length: :required, eos_token_ids: :required]},
    {SequenceBias, "sequence_bias", [sequence_bias: :required]},
    {NoBadWords, "no_bad_words", [bad_words_ids: :required, eos_token_ids: nil]}
  ]

  for {short, name, options} <- @declarations do
    module = Module.concat(__MODULE__, short)
    required = for {key, :required} <- options, do: key

    defmodule module do
      @moduledoc "The sidecar's `#{name}` processor. Options: #{Enum.map_join(options, ", ", fn {k, d} -> if d == :required, do: "`#{k}` (required)", else: "`#{k}` (default #{inspect(d)})" end)}."
      defstruct Enum.map(options, fn {key, default} ->
                  {key, if(default == :required, do: nil, else: default)}
                end)

      @type t :: %__MODULE__{}
      @doc false
      def __processor__, do: %{name: unquote(name), required: unquote(required)}
    end
  end

  @doc "Every processor module with its protocol name."
  @spec all() :: %{String.t() => module()}
  def all, do: Map.new(@declarations, fn {short, name, _} -> {name, Module.concat(__MODULE__, short)} end)

  @doc """
  Builds a processor struct from its module, or updates an existing struct. Unknown options raise
  `ArgumentError` listing the valid ones; so do missing required options.
  """
  @spec configure(module() | struct(), keyword()) :: struct()
  def configure(%module{} = config, options) when is_list(options), do: apply_options(module, config, options)

  def configure(module, options) when is_atom(module) and is_list(options) do
    unless Code.ensure_loaded?(module) and function_exported?(module, :__processor__, 0) do
      raise ArgumentError,
            "#{inspect(module)} is not a Sidecar processor; known: #{inspect(Map.values(all()))}"
    end

    config = apply_options(module, struct(module), options)
    missing = for key <- module.__processor__().required, is_nil(Map.fetch!(config, key)), do: key

    if missing != [] do
      raise ArgumentError, "#{inspect(module)} requires option(s) #{Enum.map_join(missing, ", ", &inspect/1)}"
    end

    config
  end

  defp apply_options(module, config, options) do
    valid = config |> Map.from_struct() |> Map.keys() |> Enum.sort()

    Enum.reduce(options, config, fn {key, value}, acc ->
      unless key in valid do
        raise ArgumentError,
              "unknown option #{inspect(key)} for #{inspect(module)}; valid options: " <>
                Enum.map_join(valid, ", ", &inspect/1)
      end

      Map.put(acc, key, value)
    end)
  end

  @doc "The protocol form: `%{\"name\" => ..., \"options\" => %{...}}` (options left at nil are omitted)."
  @spec to_wire(struct()) :: map()
  def to_wire(%module{} = config) do
    options =
      for {key, value} <- Map.from_struct(config), value != nil, into: %{} do
        {Atom.to_string(key), wire_value(key, value)}
      end

    %{"name" => module.__processor__().name, "options" => options}
  end

  defp wire_value(:sequence_bias, pairs),
    do:
      Enum.map(pairs, fn
        {ids, bias} -> [ids, bias]
        [ids, bias] -> [ids, bias]
      end)

  defp wire_value(_key, value), do: value
end
