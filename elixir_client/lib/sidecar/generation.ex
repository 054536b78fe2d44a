defmodule Sidecar.Generation do
  @moduledoc """
  Generation options, named as in Bumblebee's `GenerationConfig` where a name exists, mapped onto the
  protocol's `generate` parameters and processors.

    * `:max_new_tokens` (default 16), `:min_new_tokens`
    * `:strategy` - `%{type: :greedy_search}` (default) or
      `%{type: :multinomial_sampling, top_k: ..., top_p: ...}` (both optional)
    * `:temperature`, `:no_repeat_ngram_length`, `:suppressed_token_ids`, `:forced_bos_token_id`
    * `:eos_token_id` - an id or a list of ids (default: the model's; `[]` never stops early)
    * `:seed` - makes sampling reproducible
    * `:stop` - stop strings, trimmed from the text (not in Bumblebee)
    * `:processors` - more processor structs (`Sidecar.Processors`), applied after the ones above
    * `:timeout` - milliseconds before the generation is cancelled (default: the `:call_timeout`)

  The built-in processors come first, in Bumblebee's order: no-repeat n-gram, min new tokens,
  suppressed tokens, forced BOS, temperature, then top-k and top-p when sampling.
  """

  alias Sidecar.Processors

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
    :timeout
  ]

  @doc "The `generate` parameters for `input` (a string or a list of token ids). Raises on bad options."
  @spec params(String.t() | [non_neg_integer()], keyword(), [non_neg_integer()] | nil) :: map()
  def params(input, opts, model_eos_ids) do
    for {key, _} <- opts, key not in @options do
      raise ArgumentError,
            "unknown generation option #{inspect(key)}; valid options: #{Enum.map_join(@options, ", ", &inspect/1)}"
    end

    eos_ids = Keyword.get(opts, :eos_token_id, model_eos_ids)

    if opts[:min_new_tokens] && eos_ids == nil do
      raise ArgumentError, ":min_new_tokens needs :eos_token_id when the session is given by name"
    end

    {strategy, sampling} = strategy(Keyword.get(opts, :strategy, %{type: :greedy_search}))

    processors =
      [
        opts[:no_repeat_ngram_length] &&
          Processors.configure(Processors.NoRepeatNGram, ngram_size: opts[:no_repeat_ngram_length]),
        opts[:min_new_tokens] &&
          Processors.configure(Processors.MinNewTokens,
            min_new_tokens: opts[:min_new_tokens],
            eos_token_ids: List.wrap(eos_ids)
          ),
        non_empty(opts[:suppressed_token_ids]) &&
          Processors.configure(Processors.SuppressTokens, token_ids: opts[:suppressed_token_ids]),
        opts[:forced_bos_token_id] &&
          Processors.configure(Processors.ForcedBOS, token_id: opts[:forced_bos_token_id]),
        opts[:temperature] && opts[:temperature] != 1.0 &&
          Processors.configure(Processors.Temperature, temperature: opts[:temperature])
      ] ++ sampling ++ Keyword.get(opts, :processors, [])

    input_param(input)
    |> Map.merge(%{
      "max_new_tokens" => Keyword.get(opts, :max_new_tokens, 16),
      "strategy" => strategy,
      "processors" => for(p <- processors, p, do: Processors.to_wire(p)),
      "stop" => List.wrap(Keyword.get(opts, :stop, []))
    })
    |> put_present("eos_token_ids", eos_ids && List.wrap(eos_ids))
    |> put_present("seed", opts[:seed])
  end

  defp input_param(prompt) when is_binary(prompt), do: %{"prompt" => prompt}
  defp input_param(ids) when is_list(ids), do: %{"token_ids" => ids}

  defp input_param(other),
    do: raise(ArgumentError, "input must be a string or a list of token ids, got #{inspect(other)}")

  defp strategy(%{type: :greedy_search}), do: {"greedy", []}

  defp strategy(%{type: :multinomial_sampling} = s) do
    {"sample",
     [
       s[:top_k] && Processors.configure(Processors.TopK, k: s[:top_k]),
       s[:top_p] && Processors.configure(Processors.TopP, p: s[:top_p])
     ]}
  end

  defp strategy(other),
    do:
      raise(
        ArgumentError,
        "unsupported strategy #{inspect(other)}; use %{type: :greedy_search} or %{type: :multinomial_sampling}"
      )

  defp non_empty(nil), do: nil
  defp non_empty([]), do: nil
  defp non_empty(list), do: list

  defp put_present(map, _key, nil), do: map
  defp put_present(map, key, value), do: Map.put(map, key, value)
end
