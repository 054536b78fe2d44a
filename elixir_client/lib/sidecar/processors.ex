defmodule Sidecar.Processors do
  @moduledoc """
  Logits-processor configs, one struct per built-in processor of the sidecar, mirroring Bumblebee.

      top_k = Sidecar.configure(Sidecar.Processors.TopK, k: 50)
      Sidecar.generate(conn, session, "Once upon", processors: [top_k])

  Options without a default are required. An unknown option raises `ArgumentError`, as
  `Bumblebee.configure/2` does. Values are range-checked by the sidecar, which is the single authority
  on their meaning; a bad value comes back as `{:error, %Sidecar.Error{reason: :invalid_processor}}`.

  ## Constrained generation

  Five processors constrain the generated text (never the prompt) to a language; the end-of-sequence
  token is allowed exactly where the text may end, so a generation that ends by EOS ends with a whole
  match (one that runs out of `:max_new_tokens` ends with a prefix of one):

    * `Regex` - `pattern:` the whole text matches it, in Rust's regex syntax (no look-around, no
      back-references)
    * `Choice` - `options:` a non-empty list of non-empty strings; the text is exactly one of them
    * `JSONSchema` - `schema:` a map (atom or string keys) or JSON text; the text is JSON valid
      against it: compiled by outlines-core where that is exact, run by llguidance's JSON grammar
      otherwise (numeric bounds, `format`, `oneOf`, "any object"...); what neither enforces (`not`,
      `uniqueItems: true`...) is refused. A string `pattern` is matched whole.
      The object's keys are written in the schema's order: an Elixir map has none (its keys go
      sorted), so give the schema as JSON text when the order matters ("reasoning" before "answer")
    * `Grammar` - `grammar:` a context-free grammar in Lark syntax, as llguidance reads it; the
      text is one `start`
    * `DFA` - your own automaton over token ids, as Bumblebee's stateful processors take one:
      `initial_state:`, `transitions:` as `{state, token_id, next_state}` tuples (or 3-element lists),
      `accepting_states:` (default `[]`). A token with no transition from the current state is
      forbidden; EOS is allowed in accepting states and in states with no transitions but on EOS
      tokens

  `Regex`, `Choice` and `JSONSchema` take `compile_timeout_s:` (default `10.0`, at most `300`), the
  longest the sidecar may spend compiling them against the model's vocabulary; they are compiled
  once per model and cached, so a constraint used again on the same model starts at once.

  The sidecar runs constraints before every other processor, wherever they are listed, so the
  strategy's `:top_k` and `:top_p` choose among the tokens a constraint allows.
  A constraint needs an end-of-sequence token to end its text: with `eos_token_id: []` it is refused.

      json = Sidecar.configure(Sidecar.Processors.JSONSchema,
        schema: %{type: :object, properties: %{ok: %{type: :boolean}}, required: [:ok]})
      {:ok, %{text: text}} = Sidecar.generate(conn, session, "Answer in JSON:", processors: [json])

  A pattern, schema or grammar the sidecar cannot use, a `DFA` with two transitions on one token
  from one state, a vocabulary that cannot write any match, or a compile past its timeout is
  `{:error, %Sidecar.Error{reason: :invalid_processor}}`, its message naming the problem and its
  `details["index"]` the processor's position. Write `Sidecar.Processors.Regex` in full, or alias it
  under another name (`alias Sidecar.Processors.Regex, as: RegexConstraint`): a plain alias hides
  Elixir's `Regex`.
  """

  # {module, protocol name, [{option, default}]}; :required marks options without a default.
  @declarations [
    {Temperature, "temperature", [temperature: :required]},
    {TopH, "top_h", [h: :required]},
    {TopK, "top_k", [k: :required, min_tokens_to_keep: 1]},
    {TopP, "top_p", [p: :required, min_tokens_to_keep: 1]},
    {MinP, "min_p", [p: :required, min_tokens_to_keep: 1]},
    {TypicalP, "typical_p", [p: :required, min_tokens_to_keep: 1]},
    {EpsilonCutoff, "epsilon_cutoff", [epsilon: :required, min_tokens_to_keep: 1]},
    {EtaCutoff, "eta_cutoff", [epsilon: :required, min_tokens_to_keep: 1]},
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
    {NoBadWords, "no_bad_words", [bad_words_ids: :required, eos_token_ids: nil]},
    {Regex, "regex", [pattern: :required, compile_timeout_s: 10.0]},
    {Choice, "choice", [options: :required, compile_timeout_s: 10.0]},
    {JSONSchema, "json_schema", [schema: :required, compile_timeout_s: 10.0]},
    {Grammar, "grammar", [grammar: :required]},
    {DFA, "dfa", [initial_state: :required, transitions: :required, accepting_states: []]}
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
  def configure(%module{} = config, options) when is_list(options),
    do: module |> apply_options(config, options) |> required!(module)

  def configure(module, options) when is_atom(module) and is_list(options) do
    unless Code.ensure_loaded?(module) and function_exported?(module, :__processor__, 0) do
      raise ArgumentError,
            "#{inspect(module)} is not a Sidecar processor; known: #{inspect(Map.values(all()))}"
    end

    module |> apply_options(struct(module), options) |> required!(module)
  end

  def configure(module, options) do
    raise ArgumentError,
          "configure takes a processor module (or struct) and a keyword list, got #{inspect(module)} and " <>
            inspect(options, limit: 5)
  end

  defp required!(config, module) do
    missing = for key <- module.__processor__().required, is_nil(Map.fetch!(config, key)), do: key

    if missing != [] do
      raise ArgumentError, "#{inspect(module)} requires option(s) #{Enum.map_join(missing, ", ", &inspect/1)}"
    end

    config
  end

  defp apply_options(module, config, options) do
    unless Keyword.keyword?(options),
      do:
        raise(
          ArgumentError,
          "options of #{inspect(module)} must be a keyword list, got #{inspect(options, limit: 5)}"
        )

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
    unless Code.ensure_loaded?(module) and function_exported?(module, :__processor__, 0),
      do:
        raise(
          ArgumentError,
          "#{inspect(module)} is not a Sidecar processor; known: #{inspect(Map.values(all()))}"
        )

    options =
      for {key, value} <- Map.from_struct(config), value != nil, into: %{} do
        {Atom.to_string(key), wire_value(key, value)}
      end

    %{"name" => module.__processor__().name, "options" => options}
  end

  def to_wire(other) do
    raise ArgumentError,
          "a processor is a struct of Sidecar.Processors (see Sidecar.Processors.configure/2), got " <>
            inspect(other, limit: 5)
  end

  defp wire_value(:sequence_bias, pairs) when is_list(pairs),
    do:
      Enum.map(pairs, fn
        {ids, bias} -> [ids, bias]
        other -> other
      end)

  defp wire_value(:transitions, transitions) when is_list(transitions),
    do: Enum.map(transitions, fn t -> if is_tuple(t), do: Tuple.to_list(t), else: t end)

  defp wire_value(:schema, schema) when is_map(schema), do: json_keys(schema)

  defp wire_value(_key, value), do: value

  # A schema map's keys as strings: atom and string keys would otherwise both reach the sidecar, where
  # the last of two equal keys silently wins.
  defp json_keys(map) when is_map(map) and not is_struct(map) do
    Enum.reduce(map, %{}, fn {key, value}, acc ->
      name = if is_atom(key) and key not in [nil, true, false], do: Atom.to_string(key), else: key

      if Map.has_key?(acc, name) do
        raise ArgumentError,
              "the JSON schema gives the key #{inspect(name)} twice, as an atom and as a string"
      end

      Map.put(acc, name, json_keys(value))
    end)
  end

  defp json_keys(list) when is_list(list), do: Enum.map(list, &json_keys/1)
  defp json_keys(value), do: value
end
