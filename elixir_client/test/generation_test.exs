defmodule Sidecar.GenerationTest do
  use ExUnit.Case, async: true

  alias Sidecar.Generation

  test "a list of messages is a chat input, with atom or string keys and roles" do
    messages = [
      %{role: :system, content: "Be brief."},
      %{"role" => "user", "content" => "Hi"},
      %{:role => "assistant", "content" => "Hello!"}
    ]

    params = Generation.params(messages ++ [%{role: :user, content: "Hi", name: "ann"}], [], [2])

    assert params["messages"] == [
             %{"role" => "system", "content" => "Be brief."},
             %{"role" => "user", "content" => "Hi"},
             %{"role" => "assistant", "content" => "Hello!"},
             # other keys go to the template
             %{"role" => "user", "content" => "Hi", "name" => "ann"}
           ]

    refute Map.has_key?(params, "prompt") or Map.has_key?(params, "token_ids")
    # left out, the sidecar's defaults apply
    refute Map.has_key?(params, "chat_template") or Map.has_key?(params, "add_generation_prompt") or
             Map.has_key?(params, "continue_final_message")
  end

  test "the chat options go on the wire as given" do
    params =
      Generation.params(
        [%{role: "user", content: "Hi"}],
        [chat_template: "tool_use", add_generation_prompt: false, continue_final_message: true],
        nil
      )

    assert %{
             "chat_template" => "tool_use",
             "add_generation_prompt" => false,
             "continue_final_message" => true
           } = params
  end

  test "tool calls, content parts, tools, documents and template variables go to the template as given" do
    call = %{type: "function", function: %{name: "where", arguments: %{what: "sidecar"}}}
    tools = [%{type: "function", function: %{name: "where", parameters: %{type: "object"}}}]

    messages = [
      %{role: :user, content: [%{type: "text", text: "Where?"}]},
      %{role: :assistant, tool_calls: [call]},
      %{role: "tool", content: "here", tool_call_id: "0"}
    ]

    opts = [tools: tools, documents: [%{text: "d"}], chat_template_kwargs: %{enable_thinking: false}]

    assert %{
             "messages" => [
               %{"role" => "user", "content" => [%{type: "text", text: "Where?"}]},
               %{"role" => "assistant", "content" => nil, "tool_calls" => [^call]},
               %{"role" => "tool", "tool_call_id" => "0"}
             ],
             "tools" => ^tools,
             "documents" => [%{text: "d"}],
             "chat_template_kwargs" => %{enable_thinking: false}
           } = Generation.params(messages, opts, nil)

    for {bad, pattern} <- [
          {[%{role: :assistant, content: nil}],
           ~r/message 0: content must be a string or a list of content parts/},
          {[%{role: :user, content: []}], ~r/message 0: content must be/},
          {[%{role: :user, content: ["text"]}], ~r/message 0: content must be/},
          {[%{role: :assistant, tool_calls: []}], ~r/message 0 has no content/}
        ] do
      assert_raise ArgumentError, pattern, fn -> Generation.params(bad, [], nil) end
    end

    assert_raise ArgumentError, ~r/option :tools must be a list of maps/, fn ->
      Generation.params([%{role: :user, content: "a"}], [tools: %{}], nil)
    end

    assert_raise ArgumentError, ~r/option :tools applies only to a list of messages/, fn ->
      Generation.params("a", [tools: tools], nil)
    end
  end

  test "malformed messages raise ArgumentError naming the message" do
    for {bad, pattern} <- [
          {[%{role: "user"}], ~r/message 0 has no content/},
          {[%{role: "user", content: "a"}, %{content: "b"}], ~r/message 1 has no role/},
          {[%{role: "user", content: 42}], ~r/message 0: content must be a string/},
          {[%{role: nil, content: "a"}], ~r/message 0: role must be a string or an atom/},
          {[%{"role" => "user"}], ~r/message 0 has no content/},
          {[%{name: "x"}], ~r/message 0 has no role and no content/},
          {[%{:role => "user", :content => "a", 1 => "x"}], ~r/message 0: keys must be atoms or strings/},
          {[%{:role => "user", "role" => "user", :content => "a"}], ~r/message 0 gives role twice/},
          {[%{role: "user", content: "a"}, "b"], ~r/message 1 must be a map/},
          {[1, %{role: "user", content: "a"}],
           ~r/input must be a string, a list of token ids or a list of messages/},
          {%{role: "user", content: "a"}, ~r/input must be/},
          # improper lists: a FunctionClauseError from deep inside before
          {[1 | 2], ~r/input must be a proper list of token ids or messages, got \[1 \| 2\]/},
          {[%{role: "user", content: "a"} | :x], ~r/input must be a proper list/},
          {[%{role: "user", content: "a", extra: [1 | 2]}], ~r/the input holds an improper list: \[1 \| 2\]/},
          {{:continue, append_token_ids: [1 | 2]}, ~r/the input holds an improper list/},
          # the last of the two was sent
          {{:continue, tokens: 1, tokens: 2}, ~r/:continue key :tokens is given twice/}
        ] do
      assert_raise ArgumentError, pattern, fn -> Generation.params(bad, [], nil) end
    end
  end

  test "nil and false processors are skipped, as an if/2 in the list gives them" do
    top_k = Sidecar.configure(Sidecar.Processors.TopK, k: 3)

    assert %{"processors" => [%{"name" => "top_k"}]} =
             Generation.params("a", [processors: [nil, if(false, do: top_k), top_k]], nil)
  end

  test "an improper list anywhere in an option raises ArgumentError naming the option" do
    # each raised a FunctionClauseError from deep inside, or was refused at encoding naming no option
    alias Sidecar.Processors, as: P

    for {opts, name} <- [
          {[processors: [Sidecar.configure(P.TopK, k: 3) | :x]], ":processors"},
          {[processors: [Sidecar.configure(P.DFA, initial_state: 0, transitions: [{0, 5, 1} | :x])]],
           ":processors"},
          {[processors: [Sidecar.configure(P.SequenceBias, sequence_bias: [{[1], 1.0} | :x])]],
           ":processors"},
          {[processors: [Sidecar.configure(P.JSONSchema, schema: %{enum: ["a" | "b"]})]], ":processors"},
          {[processors: [Sidecar.configure(P.Choice, options: ["a" | "b"])]], ":processors"},
          {[stop: ["a" | "b"]], ":stop"},
          {[suppressed_token_ids: [1 | 2]], ":suppressed_token_ids"},
          {[eos_token_id: [2 | 3]], ":eos_token_id"}
        ] do
      assert_raise ArgumentError, ~r/^option #{name} holds an improper list/, fn ->
        Generation.params("a", opts, nil)
      end
    end
  end

  test "an explicit nil :eos_token_id is the model's, which a %Sidecar.Session{} carries" do
    # it raised ":min_new_tokens needs :eos_token_id when the session is given by name" for a struct too
    assert %{"eos_token_ids" => [2]} = Generation.params("a", [min_new_tokens: 2, eos_token_id: nil], [2])

    assert_raise ArgumentError, ~r/needs :eos_token_id when the session is given by name/, fn ->
      Generation.params("a", [min_new_tokens: 2, eos_token_id: nil, processors: []], nil)
    end

    # without :processors it changes the model's config, whose min_new_tokens the sidecar ends on the call's end
    # tokens
    assert %{"generation_config" => %{"min_new_tokens" => 2}} =
             Generation.params("a", [min_new_tokens: 2], nil)
  end

  test "an option given as nil takes its default; false is refused where it would read as not given" do
    # max_new_tokens: nil went out as nil, which the sidecar refused ("must be uint")
    default = Generation.params("a", [], nil)

    assert Generation.params(
             "a",
             [max_new_tokens: nil, strategy: nil, processors: nil, stop: nil, seed: nil],
             nil
           ) ==
             default

    # strategy, max_new_tokens, processors and stop left out are the model's (its generation config's), the
    # sidecar's to fill
    for key <- ["strategy", "max_new_tokens", "processors", "stop"], do: refute(Map.has_key?(default, key))

    assert %{"strategy" => "greedy", "processors" => [], "stop" => []} =
             Generation.params("a", [strategy: %{type: :greedy_search}, processors: [], stop: []], nil)

    # an option that makes a processor changes its field of the model's config, the others kept (Bumblebee's
    # configure); at its neutral value it turns the model's off. A sampling strategy sets top_k and top_p both.
    for {opts, changes} <- [
          {[temperature: 0.5], %{"temperature" => 0.5}},
          {[temperature: 1.0], %{"temperature" => 1.0}},
          {[suppressed_token_ids: [], no_repeat_ngram_length: 3],
           %{"suppress_tokens" => [], "no_repeat_ngram_size" => 3}},
          {[strategy: %{type: :multinomial_sampling, top_k: 5}], %{"top_k" => 5, "top_p" => 1.0}}
        ] do
      params = Generation.params("a", opts, nil)
      assert params["generation_config"] == changes and not Map.has_key?(params, "processors")
    end

    # beside :processors, they are processors of that whole list
    assert %{"processors" => [%{"name" => "top_k"}, %{"name" => "suppress_tokens"}], "strategy" => "sample"} =
             Generation.params(
               "a",
               [
                 strategy: %{type: :multinomial_sampling, top_k: 5},
                 processors: [Sidecar.configure(Sidecar.Processors.SuppressTokens, token_ids: [1])]
               ],
               nil
             )

    assert %{"processors" => []} = Generation.params("a", [temperature: 1.0, processors: []], nil)

    # more fields by name; an option wins for its own field; beside :processors, the map as given
    assert %{"generation_config" => %{"repetition_penalty" => 1.2, "temperature" => 0.5}} =
             Generation.params(
               "a",
               [generation_config: %{"repetition_penalty" => 1.2, temperature: 0.9}, temperature: 0.5],
               nil
             )

    assert %{"processors" => [], "generation_config" => %{"max_new_tokens" => 3}} =
             Generation.params("a", [generation_config: %{max_new_tokens: 3}, processors: []], nil)

    assert_raise ArgumentError, ~r/:generation_config must be a map/, fn ->
      Generation.params("a", [generation_config: [top_k: 3]], nil)
    end

    assert_raise ArgumentError, ~r/names a field twice/, fn ->
      Generation.params("a", [generation_config: %{"top_k" => 3, top_k: 4}], nil)
    end

    # beside :processors: left out where Bumblebee leaves them out, and the options that made the rest listed
    assert %{"processors" => []} =
             params =
             Generation.params("a", [no_repeat_ngram_length: 0, min_new_tokens: 2, processors: []], [])

    refute Map.has_key?(params, :processor_origins)

    # where each processor sent came from: an option, or the caller's list (nil entries skipped)
    assert %{processor_origins: [{:option, :temperature}, {:option, :strategy}, {:processors, 1}]} =
             Generation.params(
               "a",
               [
                 temperature: 0.5,
                 strategy: %{type: :multinomial_sampling, top_k: 3},
                 processors: [nil, Sidecar.configure(Sidecar.Processors.TopK, k: 2)]
               ],
               nil
             )

    refute Map.has_key?(Generation.params("a", [strategy: %{type: :greedy_search}], nil), "generation_config")

    # false is the sidecar's to refuse, naming the parameter
    assert %{"max_new_tokens" => false} = Generation.params("a", [max_new_tokens: false], nil)

    for key <- [:strategy, :processors] do
      assert_raise ArgumentError, ~r/option #{inspect(key)} cannot be false/, fn ->
        Generation.params("a", [{key, false}], nil)
      end
    end
  end

  test "a sequence of the last result is continued by index, cut and extension" do
    assert %{"continue" => %{}} = params = Generation.params(:continue, [max_new_tokens: 4], nil)
    refute Map.has_key?(params, "prompt") or Map.has_key?(params, "token_ids")

    assert %{"continue" => %{"sequence" => 2, "tokens" => -1, "append" => " and"}} =
             Generation.params({:continue, sequence: 2, tokens: -1, append: " and"}, [], nil)

    assert %{"continue" => %{"chars" => 5, "append_token_ids" => [7, 8]}} =
             Generation.params({:continue, chars: 5, append_token_ids: [7, 8]}, [], nil)

    for {bad, pattern} <- [
          {{:continue, nope: 1}, ~r/unknown :continue key :nope; valid keys: :sequence, :tokens/},
          {{:continue, sequence: -1}, ~r/:continue key :sequence must be a non-negative integer, got -1/},
          {{:continue, tokens: "2"}, ~r/:continue key :tokens must be an integer/},
          {{:continue, chars: 1.5}, ~r/:continue key :chars must be a non-negative integer/},
          {{:continue, append: :x}, ~r/:continue key :append must be a string/},
          {{:continue, append_token_ids: [-1]},
           ~r/:append_token_ids must be a list of non-negative integers/},
          {{:continue, [1]}, ~r/takes a keyword list/},
          {{:continue, 3},
           ~r/input must be a string, a list of token ids, a list of messages or \{:continue, keys\}/}
        ] do
      assert_raise ArgumentError, pattern, fn -> Generation.params(bad, [], nil) end
    end

    assert_raise ArgumentError, ~r/option :chat_template applies only to a list of messages/, fn ->
      Generation.params(:continue, [chat_template: "default"], nil)
    end
  end

  test "chat options are checked, and refused without messages" do
    messages = [%{role: "user", content: "Hi"}]

    assert_raise ArgumentError, ~r/option :chat_template must be a template name/, fn ->
      Generation.params(messages, [chat_template: :chatml], nil)
    end

    assert_raise ArgumentError, ~r/option :add_generation_prompt must be true or false/, fn ->
      Generation.params(messages, [add_generation_prompt: "yes"], nil)
    end

    assert_raise ArgumentError, ~r/option :continue_final_message must be true or false/, fn ->
      Generation.params(messages, [continue_final_message: 1], nil)
    end

    assert_raise ArgumentError, ~r/option :chat_template applies only to a list of messages/, fn ->
      Generation.params("Hi", [chat_template: "default"], nil)
    end

    assert_raise ArgumentError, ~r/option :continue_final_message applies only to a list of messages/, fn ->
      Generation.params([1, 2], [continue_final_message: false], nil)
    end
  end

  test "beam search and samples map onto the protocol's strategies, sending only the keys given" do
    beam =
      Generation.params("Hi", [strategy: %{type: :beam_search, num_beams: 3, early_stopping: :never}], nil)

    assert %{"strategy" => "beam", "num_beams" => 3, "early_stopping" => "never"} = beam
    # left out, the sidecar's defaults apply
    refute Map.has_key?(beam, "num_return_sequences") or Map.has_key?(beam, "length_penalty")
    # and its processors are the model's
    refute Map.has_key?(beam, "processors")

    assert %{"strategy" => "beam"} = Generation.params("Hi", [strategy: %{type: :beam_search}], nil)

    all = %{
      type: :beam_search,
      num_beams: 5,
      num_return_sequences: 2,
      length_penalty: 0.5,
      early_stopping: true
    }

    assert %{"num_beams" => 5, "num_return_sequences" => 2, "length_penalty" => 0.5, "early_stopping" => true} =
             Generation.params("Hi", [strategy: all], nil)

    sample =
      Generation.params("Hi", [strategy: %{type: :multinomial_sampling, top_k: 5, num_samples: 3}], nil)

    assert %{"strategy" => "sample", "num_samples" => 3, "generation_config" => %{"top_k" => 5}} = sample
    refute Map.has_key?(Generation.params("Hi", [], nil), "num_samples")

    # which option goes with which strategy is the sidecar's to judge (its error names the option)
    assert %{"strategy" => "greedy", "num_samples" => 2} =
             Generation.params("Hi", [strategy: %{type: :greedy_search, num_samples: 2}], nil)
  end

  test "reuse and keep go on the wire when given; their types are checked here" do
    params = Generation.params([5, 6], [reuse: :shift, keep: 4], nil)
    assert %{"reuse" => "shift", "keep" => 4} = params
    refute Map.has_key?(Generation.params([5, 6], [], nil), "reuse")
    # keep without shift is the sidecar's to refuse, naming the option
    assert %{"keep" => 2} = Generation.params([5, 6], [keep: 2], nil)

    assert_raise ArgumentError, ~r/:reuse must be :prefix or :shift/, fn ->
      Generation.params([5, 6], [reuse: "shift"], nil)
    end

    assert_raise ArgumentError, ~r/:keep must be a non-negative integer/, fn ->
      Generation.params([5, 6], [reuse: :shift, keep: -1], nil)
    end
  end

  test "strategy maps with an unknown key, misplaced top_k/top_p or a mistyped value raise" do
    for {strategy, pattern} <- [
          {%{type: :beam_search, beams: 4}, ~r/unknown key :beams in the strategy/},
          {%{type: :beam_search, num_beams: "4"},
           ~r/strategy option :num_beams must be a non-negative integer/},
          {%{type: :beam_search, num_return_sequences: -1}, ~r/:num_return_sequences must be a non-negative/},
          {%{type: :beam_search, length_penalty: "1.0"}, ~r/:length_penalty must be a number/},
          {%{type: :beam_search, early_stopping: :sometimes},
           ~r/:early_stopping must be true, false or :never/},
          {%{type: :multinomial_sampling, num_samples: 2.0}, ~r/:num_samples must be a non-negative integer/},
          {%{type: :beam_search, top_k: 5},
           ~r/:top_k and :top_p apply only to %{type: :multinomial_sampling}/},
          {%{type: :contrastive_search}, ~r/unsupported strategy.*:beam_search/},
          # sent as if left out
          {%{type: :multinomial_sampling, top_k: false}, ~r/strategy option :top_k cannot be false/},
          {%{type: :multinomial_sampling, top_p: false}, ~r/strategy option :top_p cannot be false/}
        ] do
      assert_raise ArgumentError, pattern, fn -> Generation.params("Hi", [strategy: strategy], nil) end
    end
  end

  test "an error about a processor an option made names the option; about the caller's, its own index" do
    error = %Sidecar.Error{
      reason: :invalid_processor,
      message: "processors[1] (top_k): option 'k' must be >= 1",
      details: %{"index" => 1}
    }

    origins = [{:option, :temperature}, {:processors, 2}]

    assert %{message: "processors[2] (top_k): option 'k' must be >= 1", details: %{"index" => 2}} =
             Generation.blame(error, origins)

    assert %{message: "option :strategy (top_k): option 'k' must be >= 1", details: details} =
             Generation.blame(error, [{:option, :temperature}, {:option, :strategy}])

    assert details == %{"option" => "strategy"}
    assert Generation.blame(error, []) == error

    # any error naming a processor by index (limit_exceeded too); a message that does not begin with its name
    over = %Sidecar.Error{reason: :limit_exceeded, message: "grammar: too slow", details: %{"index" => 0}}

    assert %{message: "option :temperature: grammar: too slow", details: %{"option" => "temperature"}} =
             Generation.blame(over, origins)

    assert %{message: "grammar: too slow", details: %{"index" => 2}} =
             Generation.blame(%{over | details: %{"index" => 1}}, origins)

    # (helper-82) an error about another parameter's element is that parameter's
    eos = %Sidecar.Error{
      reason: :invalid_params,
      message: "eos",
      details: %{"param" => "eos_token_ids", "index" => 0}
    }

    assert Generation.blame(eos, origins) == eos
  end
end
