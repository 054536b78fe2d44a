defmodule Sidecar.ProcessorsTest do
  use ExUnit.Case, async: true

  alias Sidecar.Processors
  alias Sidecar.Processors.{TopK, TopP, SequenceBias, Temperature}

  test "configure builds a struct, like Bumblebee.configure/2" do
    assert %TopK{k: 50, min_tokens_to_keep: 1} = Sidecar.configure(TopK, k: 50)
    assert %TopK{k: 5} = TopK |> Sidecar.configure(k: 50) |> Sidecar.configure(k: 5)
  end

  test "unknown options raise ArgumentError listing the valid ones" do
    assert_raise ArgumentError,
                 "unknown option :kk for Sidecar.Processors.TopK; valid options: :k, :min_tokens_to_keep",
                 fn ->
                   Sidecar.configure(TopK, kk: 3)
                 end

    assert_raise ArgumentError, ~r/requires option\(s\) :p/, fn ->
      Sidecar.configure(TopP, min_tokens_to_keep: 2)
    end

    assert_raise ArgumentError, ~r/is not a Sidecar processor/, fn -> Sidecar.configure(String, []) end

    # updating a struct checks too: a required option set to nil went out missing
    assert_raise ArgumentError, ~r/requires option\(s\) :k/, fn ->
      TopK |> Sidecar.configure(k: 3) |> Sidecar.configure(k: nil)
    end
  end

  test "wire form omits unset options" do
    assert Processors.to_wire(Sidecar.configure(TopK, k: 3)) == %{
             "name" => "top_k",
             "options" => %{"k" => 3, "min_tokens_to_keep" => 1}
           }

    assert Processors.to_wire(Sidecar.configure(SequenceBias, sequence_bias: [{[1, 2], -1.5}])) ==
             %{"name" => "sequence_bias", "options" => %{"sequence_bias" => [[[1, 2], -1.5]]}}
  end

  describe "constraints" do
    test "configure takes their options, with the sidecar's defaults" do
      assert %Processors.Regex{pattern: "[0-9]+", compile_timeout_s: 10.0} =
               Sidecar.configure(Processors.Regex, pattern: "[0-9]+")

      assert %Processors.DFA{accepting_states: []} =
               Sidecar.configure(Processors.DFA, initial_state: 0, transitions: [{0, 5, 1}])

      assert_raise ArgumentError, ~r/requires option\(s\) :options/, fn ->
        Sidecar.configure(Processors.Choice)
      end

      assert_raise ArgumentError, ~r/requires option\(s\) :grammar/, fn ->
        Sidecar.configure(Processors.Grammar)
      end
    end

    test "wire form: DFA transitions go as lists, given as tuples or lists" do
      dfa =
        Sidecar.configure(Processors.DFA,
          initial_state: 0,
          transitions: [{0, 5, 1}, [1, 6, 0]],
          accepting_states: [0]
        )

      assert Processors.to_wire(dfa) == %{
               "name" => "dfa",
               "options" => %{
                 "initial_state" => 0,
                 "transitions" => [[0, 5, 1], [1, 6, 0]],
                 "accepting_states" => [0]
               }
             }

      assert {:ok, _} = Sidecar.Msgpack.encode(Processors.to_wire(dfa))
    end

    test "wire form: a JSON schema map gets string keys at every level; JSON text goes as it is" do
      schema = %{:type => :object, "properties" => %{ok: %{type: :boolean}}, :required => [:ok]}
      wire = Processors.to_wire(Sidecar.configure(Processors.JSONSchema, schema: schema))

      expected = %{"type" => :object, "properties" => %{"ok" => %{"type" => :boolean}}, "required" => [:ok]}

      assert wire == %{
               "name" => "json_schema",
               "options" => %{"schema" => expected, "compile_timeout_s" => 10.0}
             }

      # atoms travel as str, so the bytes are those of the all-string schema
      all_strings = %{
        "type" => "object",
        "properties" => %{"ok" => %{"type" => "boolean"}},
        "required" => ["ok"]
      }

      assert encoded(wire["options"]["schema"]) == encoded(all_strings)

      text = ~s({"type": "string"})

      assert Processors.to_wire(Sidecar.configure(Processors.JSONSchema, schema: text))["options"]["schema"] ==
               text

      assert_raise ArgumentError, ~r/gives the key "type" twice/, fn ->
        Processors.to_wire(
          Sidecar.configure(Processors.JSONSchema, schema: %{:type => :object, "type" => "string"})
        )
      end
    end

    test "wire form: regex, choice and grammar options go as given" do
      assert Processors.to_wire(
               Sidecar.configure(Processors.Choice, options: ["yes", "no"], compile_timeout_s: 2)
             ) ==
               %{"name" => "choice", "options" => %{"options" => ["yes", "no"], "compile_timeout_s" => 2}}

      assert Processors.to_wire(Sidecar.configure(Processors.Grammar, grammar: ~S|start: "(" start* ")"|)) ==
               %{"name" => "grammar", "options" => %{"grammar" => ~S|start: "(" start* ")"|}}
    end
  end

  defp encoded(term) do
    {:ok, iodata} = Sidecar.Msgpack.encode(term)
    IO.iodata_to_binary(iodata)
  end

  test "Bumblebee generation options become processors in Bumblebee's order" do
    params =
      Sidecar.Generation.params(
        "hi",
        [
          max_new_tokens: 9,
          min_new_tokens: 2,
          temperature: 0.7,
          no_repeat_ngram_length: 3,
          suppressed_token_ids: [4],
          strategy: %{type: :multinomial_sampling, top_k: 40, top_p: 0.9},
          seed: 11,
          processors: [Sidecar.configure(Temperature, temperature: 2.0)]
        ],
        [2]
      )

    assert params["prompt"] == "hi" and params["max_new_tokens"] == 9 and params["strategy"] == "sample" and
             params["seed"] == 11

    assert Enum.map(params["processors"], & &1["name"]) ==
             ~w(no_repeat_ngram min_new_tokens suppress_tokens temperature top_k top_p temperature)

    assert Enum.at(params["processors"], 1)["options"]["eos_token_ids"] == [2]
    assert Sidecar.Generation.params([1, 2], [], [2])["token_ids"] == [1, 2]

    assert_raise ArgumentError, ~r/unknown generation option :top_k/, fn ->
      Sidecar.Generation.params("x", [top_k: 3], [])
    end
  end
end
