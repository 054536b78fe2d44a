defmodule Sidecar.ConstrainedGenerationTest do
  # The constraint processors against the real Python sidecar with the tiny default model. Its
  # weights are random: only the constraints give the text a shape, so each test checks the shape
  # with Elixir's own means (Regex, a JSON decoder, a parenthesis counter, the automaton's table).
  use ExUnit.Case, async: false

  import Sidecar.Test.Helpers
  alias Sidecar.{Error, Processors}

  @moduletag timeout: 180_000

  setup_all do
    %{conn: start_supervised!({Sidecar, sidecar_opts(device: "cpu")})}
  end

  setup %{conn: conn} do
    {:ok, session} = Sidecar.open_session(conn)
    on_exit(fn -> Sidecar.close_session(conn, session) end)
    %{session: session}
  end

  test "regex: the whole text matches the pattern", %{conn: conn, session: session} do
    pattern = "(yes|no), [0-9]{1,3}"
    regex = Sidecar.configure(Processors.Regex, pattern: pattern)

    assert {:ok, %{text: text, finish_reason: "eos"}} =
             Sidecar.generate(conn, session, "hi", processors: [regex], max_new_tokens: 16)

    assert Regex.match?(~r/\A(yes|no), [0-9]{1,3}\z/u, text)

    # listed first, top-k still runs after the constraint: it cuts among the tokens the pattern allows
    top_k = Sidecar.configure(Processors.TopK, k: 2)

    for seed <- 1..3 do
      opts = [
        processors: [top_k, regex],
        max_new_tokens: 16,
        strategy: %{type: :multinomial_sampling},
        seed: seed
      ]

      assert {:ok, %{text: text, finish_reason: "eos"}} = Sidecar.generate(conn, session, "hi", opts)
      assert Regex.match?(~r/\A(yes|no), [0-9]{1,3}\z/u, text), "seed #{seed}: #{inspect(text)}"

      # the strategy's own top_k, which the client puts before :processors (Bumblebee's order)
      opts = [
        processors: [regex],
        max_new_tokens: 16,
        strategy: %{type: :multinomial_sampling, top_k: 2},
        seed: seed
      ]

      assert {:ok, %{text: text, finish_reason: "eos"}} = Sidecar.generate(conn, session, "hi", opts)
      assert Regex.match?(~r/\A(yes|no), [0-9]{1,3}\z/u, text), "seed #{seed}: #{inspect(text)}"
    end
  end

  test "choice: greedy and seeded samples are each one of the options", %{conn: conn, session: session} do
    options = ["red", "green", "blue"]
    choice = Sidecar.configure(Processors.Choice, options: options)

    assert {:ok, %{text: text, finish_reason: "eos"}} =
             Sidecar.generate(conn, session, "hi", processors: [choice], max_new_tokens: 8)

    assert text in options

    sampling = [
      processors: [choice],
      max_new_tokens: 8,
      strategy: %{type: :multinomial_sampling, num_samples: 4},
      temperature: 1.5,
      seed: 3
    ]

    assert {:ok, %{sequences: samples}} = Sidecar.generate(conn, session, "hi", sampling)
    assert length(samples) == 4
    assert Enum.all?(samples, &(&1.text in options and &1.finish_reason == "eos"))
    assert samples |> Enum.map(& &1.text) |> Enum.uniq() |> length() > 1
    assert {:ok, %{sequences: ^samples}} = Sidecar.generate(conn, session, "hi", sampling)
  end

  test "json_schema: the text is JSON with the required keys, the schema a map or JSON text",
       %{conn: conn, session: session} do
    schema = %{
      type: :object,
      properties: %{ok: %{type: :boolean}, n: %{enum: [1, 2, 3]}},
      required: [:ok, :n],
      additionalProperties: false
    }

    opts = [processors: [Sidecar.configure(Processors.JSONSchema, schema: schema)], max_new_tokens: 32]
    assert {:ok, %{text: text, finish_reason: "eos"}} = Sidecar.generate(conn, session, "hi", opts)

    assert String.starts_with?(text, "{") and String.ends_with?(text, "}")
    assert text =~ ~s("ok") and text =~ ~s("n")
    assert %{"ok" => ok, "n" => n} = Sidecar.Test.JSON.decode!(text)
    assert is_boolean(ok) and n in [1, 2, 3]

    json_text =
      ~s({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},) <>
        ~s( "required": ["ok", "n"], "additionalProperties": false})

    # keys are written in the schema's order: a map's is the encoder's (sorted), JSON text keeps its own
    {from_map_ok, _} = :binary.match(text, ~s("ok"))
    {from_map_n, _} = :binary.match(text, ~s("n"))
    assert from_map_n < from_map_ok

    opts = [processors: [Sidecar.configure(Processors.JSONSchema, schema: json_text)], max_new_tokens: 32]
    assert {:ok, %{text: text, finish_reason: "eos"}} = Sidecar.generate(conn, session, "hi", opts)
    assert %{"ok" => _, "n" => _} = Sidecar.Test.JSON.decode!(text)
    {ok_at, _} = :binary.match(text, ~s("ok"))
    {n_at, _} = :binary.match(text, ~s("n"))
    assert ok_at < n_at
  end

  test "json_schema: numeric bounds are enforced (llguidance runs such a schema)",
       %{conn: conn, session: session} do
    schema = Sidecar.configure(Processors.JSONSchema, schema: %{type: :integer, minimum: 10, maximum: 99})

    for seed <- 1..4 do
      opts = [processors: [schema], max_new_tokens: 8, strategy: %{type: :multinomial_sampling}, seed: seed]
      assert {:ok, %{text: text, finish_reason: "eos"}} = Sidecar.generate(conn, session, "n", opts)
      assert Sidecar.Test.JSON.decode!(text) in 10..99
    end
  end

  test "grammar: a context-free language, balanced parentheses", %{conn: conn, session: session} do
    grammar = Sidecar.configure(Processors.Grammar, grammar: ~S|start: "(" start* ")"|)

    assert {:ok, %{text: text, finish_reason: "eos"}} =
             Sidecar.generate(conn, session, "x", processors: [grammar], max_new_tokens: 16)

    assert balanced?(text)

    sampling = [processors: [grammar], max_new_tokens: 16, strategy: %{type: :multinomial_sampling}]

    # a sample cut short by max_new_tokens is still the start of a balanced text
    for seed <- 1..4 do
      assert {:ok, %{text: text, finish_reason: finish}} =
               Sidecar.generate(conn, session, "hi", [seed: seed] ++ sampling)

      assert if(finish == "eos", do: balanced?(text), else: open_prefix?(text)), "seed #{seed}: #{text}"
    end
  end

  test "dfa: the generated tokens follow the transitions", %{conn: conn, session: session} do
    # tokens 5..9 of the tiny model are the characters # $ % & '
    transitions = [{0, 5, 1}, {0, 9, 2}, {1, 6, 0}, [1, 8, 2], {2, 7, 0}]

    dfa = Sidecar.configure(Processors.DFA, initial_state: 0, transitions: transitions, accepting_states: [0])

    table =
      Map.new(transitions, fn t ->
        {s, token, next} = triple(t)
        {{s, token}, next}
      end)

    for seed <- 1..3 do
      opts = [processors: [dfa], max_new_tokens: 12, strategy: %{type: :multinomial_sampling}, seed: seed]
      assert {:ok, %{token_ids: ids, finish_reason: finish}} = Sidecar.generate(conn, session, "hi", opts)

      {steps, eos} = if finish == "eos", do: {Enum.drop(ids, -1), List.last(ids)}, else: {ids, nil}
      state = Enum.reduce(steps, 0, fn token, state -> Map.fetch!(table, {state, token}) end)
      assert eos in [nil | session.eos_token_ids]
      assert eos == nil or state == 0, "EOS in the non-accepting state #{state}"
    end
  end

  describe "errors" do
    test "a regex with look-around is invalid_processor, naming it and its index", %{
      conn: conn,
      session: session
    } do
      processors = [
        Sidecar.configure(Processors.Choice, options: ["ab"]),
        Sidecar.configure(Processors.Regex, pattern: "a(?=b)")
      ]

      assert {:error, %Error{reason: :invalid_processor, message: message, details: %{"index" => 1}}} =
               Sidecar.generate(conn, session, "hi", processors: processors)

      assert message =~ "look-around"
    end

    test "a DFA with two transitions on one token from one state is invalid_processor",
         %{conn: conn, session: session} do
      dfa = Sidecar.configure(Processors.DFA, initial_state: 0, transitions: [{0, 5, 1}, {0, 5, 2}])

      assert {:error, %Error{reason: :invalid_processor, message: message, details: %{"index" => 0}}} =
               Sidecar.generate(conn, session, "hi", processors: [dfa])

      assert message =~ "not deterministic"
    end

    test "refused constraints leave the session as it was, and it still generates", %{
      conn: conn,
      session: session
    } do
      assert {:ok, _} = Sidecar.generate(conn, session, "hi", max_new_tokens: 4)
      {:ok, before} = Sidecar.session_info(conn, session)

      for bad <- [
            Sidecar.configure(Processors.Regex, pattern: "a(?=b)"),
            Sidecar.configure(Processors.DFA, initial_state: 0, transitions: [{0, 5, 1}, {0, 5, 2}]),
            Sidecar.configure(Processors.Grammar, grammar: "start: ("),
            Sidecar.configure(Processors.JSONSchema, schema: %{type: :objekt}),
            # what neither backend enforces
            Sidecar.configure(Processors.JSONSchema, schema: %{type: :array, items: %{}, uniqueItems: true})
          ] do
        assert {:error, %Error{reason: :invalid_processor}} =
                 Sidecar.generate(conn, session, "hi", processors: [bad])
      end

      assert {:ok, ^before} = Sidecar.session_info(conn, session)

      choice = Sidecar.configure(Processors.Choice, options: ["yes", "no"])
      assert {:ok, %{text: text}} = Sidecar.generate(conn, session, "hi", processors: [choice])
      assert text in ["yes", "no"]

      assert {:ok, %{token_ids: [_, _, _, _]}} =
               Sidecar.generate(conn, session, "hi", max_new_tokens: 4, eos_token_id: [])
    end

    test "a constraint without an end-of-sequence token is refused", %{conn: conn, session: session} do
      choice = Sidecar.configure(Processors.Choice, options: ["yes", "no"])

      assert {:error, %Error{reason: :invalid_processor, message: message}} =
               Sidecar.generate(conn, session, "hi", processors: [choice], eos_token_id: [])

      assert message =~ "end-of-sequence"
    end
  end

  defp triple({state, token, next}), do: {state, token, next}
  defp triple([state, token, next]), do: {state, token, next}

  defp balanced?(text), do: text != "" and unclosed(text) == 0

  defp open_prefix?(text), do: is_integer(unclosed(text))

  # The parentheses a text leaves open, or :invalid if it closes one it never opened or has anything else.
  defp unclosed(text) do
    text
    |> String.graphemes()
    |> Enum.reduce_while(0, fn
      "(", depth -> {:cont, depth + 1}
      ")", depth when depth > 0 -> {:cont, depth - 1}
      _, _ -> {:halt, :invalid}
    end)
  end
end
