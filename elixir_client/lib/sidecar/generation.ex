defmodule Sidecar.Generation do
  @moduledoc """
  Generation options, named as in Bumblebee's `GenerationConfig` where a name exists, mapped onto the
  protocol's `generate` parameters and processors.

  The input is a string, a list of token ids (a charlist such as `'hello'` is one: write `"hello"`),
  or a conversation: a list of messages
  `%{role: "user", content: "Hi"}` (atom or string keys, the role an atom or a string; other keys go
  to the template as they are), rendered by the model's own chat template (transformers'
  `apply_chat_template`). A model without a chat template
  answers `reason: :no_chat_template`.

  The input may also be a sequence of the session's last result, continued: `:continue` (all the
  tokens of its first or best sequence, input and generated) or `{:continue, keyword}` with

    * `:sequence` - which of the result's `:sequences` (default 0)
    * `:tokens` - keep its first `k` tokens (negative: all but the last `-k`)
    * `:chars` - keep the tokens of its first `n` characters, rounded down to a token boundary
    * `:append` - then append the tokens of this text (tokenized alone, without special tokens), or
    * `:append_token_ids` - these token ids

  After one sequence the session's cache holds the last input and that sequence, so continuing reuses
  it; after several samples or beams it holds the input only (`stats.reused_tokens` says how much is
  reused). A `:sequence` the last result does not have is
  `reason: :sample_mismatch`; no result yet, `:tokens` or `:chars` past the sequence's end, or both of
  two exclusive keys are `reason: :invalid_argument` with `details["option"]` naming the key
  (`"continue.tokens"`, ...). An unknown key or a value of the wrong type raises `ArgumentError`.

  With messages only:

    * `:chat_template` - the name of one of the model's templates, as listed in its model info's
      `"chat_templates"` (`session.model["chat_templates"]`); default: the model's default
    * `:add_generation_prompt` - open the assistant's turn after the messages (default: `true`
      unless `:continue_final_message`)
    * `:continue_final_message` - extend the last message instead of answering it (default: `false`)
    * `:tools` - the functions the model may call, each a map as transformers' `apply_chat_template`
      takes it (`%{type: "function", function: %{name: ..., description: ..., parameters: schema}}`)
    * `:documents` - documents for a retrieval template (maps)
    * `:chat_template_kwargs` - more variables of the template (`%{enable_thinking: false}` for Qwen3)

  A message's `content` may also be a list of content parts (`[%{type: "text", text: "..."}]`), or be
  left out in an assistant message with `tool_calls`.

  Other options:

    * `:max_new_tokens` (default: the model's, 16 unless its generation config says), `:min_new_tokens`
    * `:strategy` - one of the maps below (default: the model's, `%{type: :greedy_search}` unless its
      generation config says `do_sample`: the model info's `"generation_defaults"`)
    * `:temperature`, `:no_repeat_ngram_length`, `:suppressed_token_ids`, `:forced_bos_token_id` -
      each changes its field of the model's generation config for this call, the others staying the
      model's, as `Bumblebee.configure/2` changes a loaded `GenerationConfig` (Llama 3's `top_p` stays
      when `:temperature` changes; `temperature: 1.0` and `suppressed_token_ids: []` turn the model's
      off). A sampling strategy map sets `top_k` and `top_p` both, as Bumblebee's replaces the loaded
      strategy: a key it leaves out is none, not the model's. The fields are transformers': the
      temperature applies when sampling, as transformers applies it (beams ignore it: give
      `Temperature` in `:processors` to scale their scores), and a value the sidecar refuses is
      `reason: :invalid_argument` with `details["option"] == "generation_config"` and
      `details["field"]` the field (`"suppress_tokens"` for `:suppressed_token_ids`). Beside
      `:processors` they make processors instead (below), left out at the values Bumblebee leaves
      them out at (`no_repeat_ngram_length: 0`, `:min_new_tokens` without an end token), and an error
      about one of those processors names its option in `details["option"]` (`"temperature"`, say)
    * `:generation_config` - a map of more fields of the model's generation config to change, as
      transformers names them (`%{repetition_penalty: 1.2, min_p: 0.05}`), atom or string keys:
      `sequence_bias`, `repetition_penalty`, `no_repeat_ngram_size`, `bad_words_ids`, `min_length`,
      `min_new_tokens`, `forced_bos_token_id`, `suppress_tokens`, `begin_suppress_tokens`,
      `temperature`, `top_h`, `top_k`, `top_p`, `min_p`, `typical_p`, `epsilon_cutoff`, `eta_cutoff`,
      `do_sample`, `max_new_tokens`, `stop_strings` (PROTOCOL.md, "Generation defaults"); the options
      above win over it for their own fields. Beside `:processors` it is sent as given, and the
      sidecar refuses its fields that make a processor: only `do_sample`, `max_new_tokens`,
      `stop_strings` and neutral values go there
    * `:eos_token_id` - an id or a list of ids (default: the model's; `[]` never stops early)
    * `:seed` - makes sampling reproducible
    * `:stop` - stop strings, trimmed from the text (not in Bumblebee; default: the model's)
    * `:logprobs` - `k` from 0 to 20: each sequence (and the result, for the first) also carries
      `:logprobs`, each generated token's log-probability under the model (before any processor,
      as vLLM's `logprobs`), and `:top_logprobs`, for each token the step's `k` most likely as
      `{token_id, logprob}`, most likely first; each streamed chunk its `:logprob` and
      `:top_logprobs` (beam search streams none; its beams carry theirs). A value past 20 is
      `reason: :invalid_argument` with `details["option"] == "logprobs"`; a reply that could not fit
      the sidecar's frame were every row to reach `:max_new_tokens` is `reason: :limit_exceeded`
      before it starts. Left out, they are `nil`
    * `:prompt_logprobs` - `k` from 0 to 20: the result also carries `:prompt_token_ids` (the prompt
      as the sidecar tokenized or rendered it), `:prompt_logprobs`, each prompt token's
      log-probability given those before it (`nil` for the first, which follows nothing), and
      `:prompt_top_logprobs`, the `k` most likely there (`nil` for the first), as vLLM's
      `prompt_logprobs`: with `max_new_tokens: 0`, a text's score. The prompt is computed anew,
      reusing no cache. With `reuse: :shift` it is `reason: :invalid_argument`
    * `:processors` - processor structs (`Sidecar.Processors`); `nil` and `false` entries are
      skipped, so `if(...)` may stand in the list. Without it, the model's generation config gives
      the processors, as in transformers and Bumblebee (`repetition_penalty`, `temperature`... of its
      `generation_config.json`: the model info's `"generation_defaults"`), changed by the options
      above. With it, the processors are the whole list: those of the options above, then these, and
      none of the model's (`processors: []` is none at all)
    * `:reuse` - how the session reuses its KV cache: `:prefix` (the default: the longest common
      prefix, exact) or `:shift` (opt-in, approximate: a window that slid reuses its cached tokens
      moved back by the number dropped; a model without rotary positions answers
      `reason: :invalid_argument` naming `"reuse"`). `stats.shifted_tokens` counts the moved tokens.
    * `:keep` - with `reuse: :shift`, the leading tokens that stay in place (attention sinks, a system
      prompt; default 0)
    * `:timeout` - milliseconds before the generation is cancelled (default: the `:call_timeout`)

  An option given as `nil` takes its default, as if it were left out; `false` is refused where it
  would mean the same. A value of the wrong type or sign for one of the protocol's own parameters
  (`:max_new_tokens`, `:seed`, `:eos_token_id`) is `reason: :invalid_params` with `details["param"]`
  naming it; the processors' and the generation config's values are the sidecar's to judge, as above.

  Beside `:processors`, the options' processors come first, in Bumblebee's order: no-repeat n-gram,
  min new tokens, suppressed tokens, forced BOS, temperature, then top-k and top-p when sampling.
  Without it, the model's and the options' together apply in transformers' order.

  ## Strategies

    * `%{type: :greedy_search}` - the most likely token at each step (the default, unless the
      model's generation config says `do_sample`)
    * `%{type: :multinomial_sampling, top_k: k, top_p: p, num_samples: n}` - sampling, each key
      optional. `:num_samples` (default 1) draws `n` sequences from one prefill of the input; one
      `:seed` reproduces all of them.
    * `%{type: :beam_search, num_beams: 4, num_return_sequences: 1, length_penalty: 1.0,
      early_stopping: false}` - beam search with transformers' semantics, each key optional with
      those defaults. `:early_stopping` is `true`, `false` or `:never`. The `:num_return_sequences`
      best beams come back, best first, each with its score (sum of the token log-probabilities
      divided by generated length ** `:length_penalty`). Beam search streams no tokens (beams are
      reordered until the end) and takes no `:stop` strings.

  Several sequences come back in the result's `:sequences`, a list of
  `%{text: ..., token_ids: ..., finish_reason: ..., score: ...}` (`score` is `nil` but for beams);
  the result's own `:text`, `:token_ids` and `:finish_reason` are those of the first. The session
  keeps the input and the first sequence as its history.

  A strategy map with an unknown key, `:top_k`/`:top_p` outside sampling, or a value of the wrong
  type (`:num_samples`, `:num_beams` and `:num_return_sequences` non-negative integers,
  `:length_penalty` a number) raises `ArgumentError`. The other checks are the sidecar's, which
  answers `{:error, %Sidecar.Error{reason: :invalid_argument, details: %{"option" => name}}}` naming
  the option: a sequence option that does not go with the strategy (`:num_samples` above 1 with
  greedy search, say), `num_beams: 0`, `:num_return_sequences` above `:num_beams`, `:stop` with
  beam search. `:num_beams` and `:num_samples` above the sidecar's `max_sequences` are
  `reason: :limit_exceeded`. A generation whose KV cache (input + rows x `:max_new_tokens`
  tokens) cannot fit the sidecar's cache budget is `reason: :cache_budget_exceeded`.
  """

  alias Sidecar.{Options, Processors}

  # {option, check, what it must be}; only with messages
  @chat_options [
    {:chat_template, &is_binary/1, "a template name"},
    {:add_generation_prompt, &is_boolean/1, "true or false"},
    {:continue_final_message, &is_boolean/1, "true or false"},
    {:tools, &__MODULE__.maps?/1, "a list of maps"},
    {:documents, &__MODULE__.maps?/1, "a list of maps"},
    {:chat_template_kwargs, &is_map/1, "a map"}
  ]

  @options [
    :max_new_tokens,
    :min_new_tokens,
    :strategy,
    :temperature,
    :no_repeat_ngram_length,
    :suppressed_token_ids,
    :forced_bos_token_id,
    :eos_token_id,
    :seed,
    :stop,
    :processors,
    :generation_config,
    :logprobs,
    :prompt_logprobs,
    :reuse,
    :keep,
    :timeout
    | for({key, _, _} <- @chat_options, do: key)
  ]

  # {option, the generation config field it changes}
  @config_fields [
    no_repeat_ngram_length: "no_repeat_ngram_size",
    min_new_tokens: "min_new_tokens",
    suppressed_token_ids: "suppress_tokens",
    forced_bos_token_id: "forced_bos_token_id",
    temperature: "temperature"
  ]

  # options read as "given" only when truthy
  @no_false [
    :strategy,
    :processors,
    :min_new_tokens,
    :temperature,
    :no_repeat_ngram_length,
    :suppressed_token_ids,
    :forced_bos_token_id,
    :eos_token_id
  ]

  @typedoc "A chat message: `role` and `content` (and any other key the template reads), atom or string keys."
  @type message :: %{
          required(:role | String.t()) => atom() | String.t(),
          required(:content | String.t()) => String.t()
        }
  @type input :: String.t() | [non_neg_integer()] | [message()] | :continue | {:continue, keyword()}

  # {key, check, what it must be}: the keys of a `{:continue, keyword}` input
  @continue_keys [
    {:sequence, :uint, "a non-negative integer"},
    {:tokens, :int, "an integer"},
    {:chars, :uint, "a non-negative integer"},
    {:append, :string, "a string"},
    {:append_token_ids, :token_ids, "a list of non-negative integers"}
  ]

  @doc """
  The `generate` parameters for `input` (a string, a list of token ids, a list of messages or
  `{:continue, keys}`).
  Raises `ArgumentError` on bad options or a malformed message.
  """
  @spec params(input(), keyword(), [non_neg_integer()] | nil) :: map()
  def params(input, opts, model_eos_ids) do
    known!(opts)
    for {key, value} <- opts, do: Options.proper!(value, "option #{inspect(key)}")

    if is_list(input) and List.improper?(input) do
      raise ArgumentError,
            "input must be a proper list of token ids or messages, got #{inspect(input, limit: 8)}"
    end

    Options.proper!(input, "the input")
    Options.timeout!(opts[:timeout])

    unless is_list(opts[:processors] || []),
      do:
        raise(
          ArgumentError,
          ":processors must be a list of processor structs, got #{inspect(opts[:processors], limit: 5)}"
        )

    # false would read as "not given" below: an option given must be used or refused
    for key <- @no_false, Keyword.get(opts, key) == false do
      raise ArgumentError, "option #{inspect(key)} cannot be false (leave it out, or nil, for its default)"
    end

    stop = opts[:stop] && List.wrap(opts[:stop])

    unless Enum.all?(stop || [], &is_binary/1),
      do:
        raise(
          ArgumentError,
          ":stop must be a string or a list of strings, got #{inspect(opts[:stop], limit: 5)}"
        )

    # nil, given or not, is the model's own end tokens, which a session given by name does not carry
    eos_ids = Keyword.get(opts, :eos_token_id) || model_eos_ids

    if opts[:min_new_tokens] && opts[:processors] != nil && eos_ids == nil do
      raise ArgumentError,
            ":min_new_tokens beside :processors needs :eos_token_id when the session is given by name (the " <>
              "model's end tokens come with a %Sidecar.Session{})"
    end

    {strategy, sequence_params, sampling} =
      if opts[:strategy], do: strategy(opts[:strategy]), else: {nil, %{}, []}

    # With :processors given, the processors are these options' and those, the whole list; without, the
    # options change their fields of the model's generation config, as `Bumblebee.configure/2` changes the
    # loaded one: its other fields stay (`generation_config`)
    {processors, origins, config} =
      if opts[:processors] != nil do
        # each processor sent, with where it came from: {:option, name}, or {:processors, its index there}
        # (nil and false entries are skipped)
        sent =
          for({option, p} <- option_processors(opts, eos_ids, sampling), do: {{:option, option}, p}) ++
            for {p, i} <- Enum.with_index(opts[:processors]), p, do: {{:processors, i}, p}

        {Enum.map(sent, &Processors.to_wire(elem(&1, 1))), Enum.map(sent, &elem(&1, 0)),
         generation_config!(opts)}
      else
        {nil, [], config_changes(opts)}
      end

    input
    |> input_param(opts)
    |> Map.merge(sequence_params)
    |> put_present("max_new_tokens", opts[:max_new_tokens])
    |> put_present("strategy", strategy)
    |> put_present("processors", processors)
    |> put_present("generation_config", config)
    |> put_present("stop", stop)
    |> put_present("eos_token_ids", eos_ids && List.wrap(eos_ids))
    |> put_present("seed", opts[:seed])
    |> put_present("logprobs", opts[:logprobs])
    |> put_present("prompt_logprobs", opts[:prompt_logprobs])
    |> put_present("reuse", reuse!(opts[:reuse]))
    |> put_present("keep", keep!(opts[:keep]))
    |> put_present(:processor_origins, if(origins != [], do: origins))
  end

  # {option, processor} for each option that makes one beside :processors, in Bumblebee's order and as
  # Bumblebee leaves them out: no n-gram ban of length 0, no minimum without an end token.
  defp option_processors(opts, eos_ids, sampling) do
    eos_ids = List.wrap(eos_ids || [])

    made = [
      no_repeat_ngram_length:
        (opts[:no_repeat_ngram_length] || 0) != 0 &&
          Processors.configure(Processors.NoRepeatNGram, ngram_size: opts[:no_repeat_ngram_length]),
      min_new_tokens:
        opts[:min_new_tokens] && eos_ids != [] &&
          Processors.configure(Processors.MinNewTokens,
            min_new_tokens: opts[:min_new_tokens],
            eos_token_ids: eos_ids
          ),
      suppressed_token_ids:
        non_empty(opts[:suppressed_token_ids]) &&
          Processors.configure(Processors.SuppressTokens, token_ids: opts[:suppressed_token_ids]),
      forced_bos_token_id:
        opts[:forced_bos_token_id] &&
          Processors.configure(Processors.ForcedBOS, token_id: opts[:forced_bos_token_id]),
      temperature:
        opts[:temperature] && opts[:temperature] != 1.0 &&
          Processors.configure(Processors.Temperature, temperature: opts[:temperature])
    ]

    for {option, p} <- made ++ Enum.map(sampling, &{:strategy, &1}), p, do: {option, p}
  end

  @doc false
  # The sidecar's error about the processor it sent at `details["index"]` (an error about another
  # parameter, naming it in `details["param"]`, indexes that one's elements), of a request whose processors
  # came from `origins` (`params/3`'s :processor_origins): blamed on the option that made it, or given the
  # index the caller's own :processors list has it at. Its message is renamed where it begins with that
  # processor's name (`processors[i]`), and says the option's name otherwise.
  @spec blame(Sidecar.Error.t(), [{:option, atom()} | {:processors, non_neg_integer()}]) :: Sidecar.Error.t()
  def blame(%Sidecar.Error{details: %{"index" => i} = details} = error, [_ | _] = origins)
      when is_integer(i) and i >= 0 and i < length(origins) and
             (not is_map_key(details, "param") or :erlang.map_get("param", details) == "processors") do
    origin = Enum.at(origins, i)

    {name, details} =
      case origin do
        {:option, option} ->
          {"option #{inspect(option)}",
           details |> Map.delete("index") |> Map.put("option", Atom.to_string(option))}

        {:processors, j} ->
          {"processors[#{j}]", Map.put(details, "index", j)}
      end

    prefix = "processors[#{i}]"

    message =
      cond do
        String.starts_with?(error.message, prefix) -> name <> String.replace_prefix(error.message, prefix, "")
        match?({:option, _}, origin) -> name <> ": " <> error.message
        true -> error.message
      end

    %{error | message: message, details: details}
  end

  def blame(error, _origins), do: error

  @doc false
  # Raises unless `opts` is a keyword list of generation options: checked before any of them is read.
  @spec known!(term()) :: :ok
  def known!(opts), do: Options.known!(opts, @options, "generation")

  @doc false
  # Whether a generation streams no tokens, its reply alone carrying the result: a beam search of more
  # than one beam (the sidecar's default is 4; one beam is greedy search, which streams).
  @spec unstreamed?(keyword()) :: boolean()
  def unstreamed?(opts) do
    case opts[:strategy] do
      %{type: :beam_search} = strategy -> Map.get(strategy, :num_beams) != 1
      _ -> false
    end
  end

  defp input_param(prompt, opts) when is_binary(prompt), do: no_chat_options!(opts, %{"prompt" => prompt})

  defp input_param(:continue, opts), do: input_param({:continue, []}, opts)

  defp input_param({:continue, keys}, opts) when is_list(keys) do
    unless Keyword.keyword?(keys),
      do: raise(ArgumentError, "{:continue, keys} takes a keyword list, got #{inspect(keys)}")

    for {key, _} <- keys, not List.keymember?(@continue_keys, key, 0) do
      raise ArgumentError,
            "unknown :continue key #{inspect(key)}; valid keys: " <>
              Enum.map_join(@continue_keys, ", ", &inspect(elem(&1, 0)))
    end

    continued = typed!(keys, @continue_keys, ":continue key")
    no_chat_options!(opts, %{"continue" => continued})
  end

  defp input_param([message | _] = messages, opts) when is_map(message) do
    for {key, ok?, expected} <- @chat_options,
        reduce: %{"messages" => Enum.with_index(messages, &message!/2)} do
      params -> put_present(params, Atom.to_string(key), option!(opts, key, ok?, expected))
    end
  end

  defp input_param(ids, opts) when is_list(ids) do
    unless Enum.all?(ids, &is_integer/1) do
      raise ArgumentError,
            "input must be a string, a list of token ids or a list of messages, got #{inspect(ids, limit: 8)}"
    end

    no_chat_options!(opts, %{"token_ids" => ids})
  end

  defp input_param(other, _opts),
    do:
      raise(
        ArgumentError,
        "input must be a string, a list of token ids, a list of messages or {:continue, keys}, " <>
          "got #{inspect(other, limit: 8)}"
      )

  defp no_chat_options!(opts, param) do
    case Enum.find(@chat_options, fn {key, _, _} -> Keyword.has_key?(opts, key) end) do
      nil -> param
      {key, _, _} -> raise ArgumentError, "option #{inspect(key)} applies only to a list of messages"
    end
  end

  defp option!(opts, key, ok?, expected) do
    value = opts[key]

    unless value == nil or ok?.(value) do
      raise ArgumentError, "option #{inspect(key)} must be #{expected}, got #{inspect(value)}"
    end

    value
  end

  @doc false
  def maps?(value), do: is_list(value) and value != [] and Enum.all?(value, &is_map/1)

  # `role` and `content` are required; other keys go to the template as they are (a template may
  # use `name`, for example). Each key is an atom or a string, never both.
  defp message!(message, index) when is_map(message) do
    message =
      Map.new(message, fn
        {key, value} when is_atom(key) and key not in [nil, true, false] ->
          if Map.has_key?(message, Atom.to_string(key)),
            do: raise(ArgumentError, "message #{index} gives #{key} twice, as an atom and a string key")

          {Atom.to_string(key), value}

        {key, value} when is_binary(key) ->
          {key, value}

        {key, _} ->
          raise ArgumentError, "message #{index}: keys must be atoms or strings, got #{inspect(key)}"
      end)

    role = message["role"]
    content = Map.get(message, "content", :absent)

    cond do
      not Map.has_key?(message, "role") or (content == :absent and not calls_tools?(message)) ->
        missing = Enum.reject(["role", "content"], &Map.has_key?(message, &1))

        raise ArgumentError,
              "message #{index} has no #{Enum.join(missing, " and no ")}: #{inspect(message, limit: 8)}"

      not (is_binary(role) or (is_atom(role) and role not in [nil, true, false])) ->
        raise ArgumentError, "message #{index}: role must be a string or an atom, got #{inspect(role)}"

      is_binary(content) or maps?(content) ->
        %{message | "role" => to_string(role)}

      # a message calling tools may leave its content out, or nil
      content in [nil, :absent] and calls_tools?(message) ->
        Map.merge(message, %{"role" => to_string(role), "content" => nil})

      true ->
        raise ArgumentError,
              "message #{index}: content must be a string or a list of content parts (maps), or left out " <>
                "with tool_calls, got #{inspect(content, limit: 8)}"
    end
  end

  defp message!(other, index),
    do:
      raise(
        ArgumentError,
        "message #{index} must be a map with role and content, got #{inspect(other, limit: 8)}"
      )

  defp calls_tools?(message), do: match?(%{"tool_calls" => [_ | _]}, message)

  # The protocol's name of each strategy type.
  @strategies %{
    greedy_search: "greedy",
    multinomial_sampling: "sample",
    beam_search: "beam"
  }

  # {key, check, what it must be}: protocol parameters of several sequences, sent as given. Which go
  # with which strategy, and their ranges, are the sidecar's to judge: its error names the option.
  @sequence_options [
    {:num_samples, :uint, "a non-negative integer"},
    {:num_beams, :uint, "a non-negative integer"},
    {:num_return_sequences, :uint, "a non-negative integer"},
    {:length_penalty, :number, "a number"},
    {:early_stopping, :early_stopping, "true, false or :never"}
  ]

  @strategy_keys [:type, :top_k, :top_p | for({key, _, _} <- @sequence_options, do: key)]

  # {the protocol's strategy name, its parameters, the sampling processors}
  defp strategy(%{type: type} = s) when is_map_key(@strategies, type) do
    for {key, _} <- s, key not in @strategy_keys do
      raise ArgumentError,
            "unknown key #{inspect(key)} in the strategy #{inspect(s)}; valid keys: " <>
              Enum.map_join(@strategy_keys, ", ", &inspect/1)
    end

    if type != :multinomial_sampling and (Map.has_key?(s, :top_k) or Map.has_key?(s, :top_p)) do
      raise ArgumentError, ":top_k and :top_p apply only to %{type: :multinomial_sampling}, got #{inspect(s)}"
    end

    for key <- [:top_k, :top_p], Map.get(s, key) == false do
      raise ArgumentError, "strategy option #{inspect(key)} cannot be false (leave it out, or nil, for none)"
    end

    params = typed!(s, @sequence_options, "strategy option")

    sampling = [
      s[:top_k] && Processors.configure(Processors.TopK, k: s[:top_k]),
      s[:top_p] && Processors.configure(Processors.TopP, p: s[:top_p])
    ]

    {Map.fetch!(@strategies, type), params, sampling}
  end

  defp strategy(other),
    do:
      raise(
        ArgumentError,
        "unsupported strategy #{inspect(other)}; use %{type: :greedy_search}, " <>
          "%{type: :multinomial_sampling} or %{type: :beam_search}"
      )

  # Whether `:keep` goes with the reuse given is the sidecar's to judge: its error names the option.
  defp reuse!(nil), do: nil
  defp reuse!(reuse) when reuse in [:prefix, :shift], do: Atom.to_string(reuse)

  defp reuse!(other),
    do: raise(ArgumentError, "option :reuse must be :prefix or :shift, got #{inspect(other)}")

  defp keep!(keep) when is_nil(keep) or (is_integer(keep) and keep >= 0), do: keep

  defp keep!(other),
    do: raise(ArgumentError, "option :keep must be a non-negative integer, got #{inspect(other)}")

  # The keys of `given` (a keyword list or a map) that `table` ({key, type, what it must be}) declares,
  # each checked, as the protocol's string-keyed map; `label` names a key in the error.
  defp typed!(given, table, label) do
    # a keyword list may name a key twice, where the last would silently win
    if is_list(given) do
      keys = Keyword.keys(given)

      for key <- Enum.uniq(keys -- Enum.uniq(keys)),
          do: raise(ArgumentError, "#{label} #{inspect(key)} is given twice, in #{inspect(given)}")
    end

    for {key, type, expected} <- table, {^key, value} <- given, into: %{} do
      unless valid?(type, value),
        do: raise(ArgumentError, "#{label} #{inspect(key)} must be #{expected}, got #{inspect(value)}")

      {Atom.to_string(key), if(value == :never, do: "never", else: value)}
    end
  end

  defp valid?(:uint, value), do: is_integer(value) and value >= 0
  defp valid?(:int, value), do: is_integer(value)
  defp valid?(:string, value), do: is_binary(value)
  defp valid?(:token_ids, value), do: is_list(value) and Enum.all?(value, &valid?(:uint, &1))
  defp valid?(:number, value), do: is_number(value)
  defp valid?(:early_stopping, value), do: value in [true, false, :never, "never"]

  # The fields of the model's generation config that the options given change; nil for none. A
  # sampling strategy map sets both top_k and top_p, as Bumblebee's strategy replaces the loaded one
  # whole: a key left out is none (0, 1.0), not the model's.
  defp config_changes(opts) do
    changes =
      for {option, field} <- @config_fields,
          opts[option] != nil,
          into: generation_config!(opts) || %{},
          do: {field, opts[option]}

    changes =
      case opts[:strategy] do
        %{type: :multinomial_sampling} = s ->
          Map.merge(changes, %{"top_k" => s[:top_k] || 0, "top_p" => s[:top_p] || 1.0})

        _ ->
          changes
      end

    if changes != %{}, do: changes
  end

  # The :generation_config map with string keys, as the protocol's; nil when not given.
  defp generation_config!(opts) do
    case opts[:generation_config] do
      nil ->
        nil

      %{} = config ->
        changes =
          for {key, value} <- config, into: %{} do
            unless is_atom(key) or is_binary(key),
              do: raise(ArgumentError, ":generation_config keys are atoms or strings, got #{inspect(key)}")

            {to_string(key), value}
          end

        # an atom key and its string spelled the same: which value is meant cannot be told
        if map_size(changes) < map_size(config),
          do:
            raise(
              ArgumentError,
              ":generation_config names a field twice, as an atom and a string: #{inspect(config)}"
            )

        changes

      other ->
        raise ArgumentError,
              ":generation_config must be a map of fields to values, got #{inspect(other, limit: 5)}"
    end
  end

  defp non_empty(nil), do: nil
  defp non_empty([]), do: nil
  defp non_empty(list), do: list

  defp put_present(map, _key, nil), do: map
  defp put_present(map, key, value), do: Map.put(map, key, value)
end
