defmodule Sidecar.MsgpackTest do
  use ExUnit.Case, async: true
  import Bitwise

  import Sidecar.Test.Helpers
  alias Sidecar.Msgpack

  describe "golden vectors of the protocol" do
    for vector <- Sidecar.Test.Helpers.vectors("codec.json")["vectors"] do
      @vector vector
      test "codec: #{vector["name"]}" do
        value = from_json(@vector["value"])
        bytes = Base.decode16!(@vector["hex"], case: :lower)
        assert Msgpack.decode(bytes) == {:ok, value}
        assert {:ok, iodata} = Msgpack.encode(value)
        assert IO.iodata_to_binary(iodata) == bytes
      end
    end

    test "every conformance request encodes to its golden frame" do
      steps =
        for script <- vectors("conformance.json")["scripts"],
            step <- script["steps"],
            Map.has_key?(step, "request"),
            do: step

      assert length(steps) >= 82

      for %{"request" => request, "send_hex" => hex} <- steps do
        <<length::32, payload::binary>> = Base.decode16!(hex, case: :lower)
        {:ok, iodata} = Msgpack.encode(from_json(request))
        assert IO.iodata_to_binary(iodata) == payload
        assert length == byte_size(payload)
      end
    end
  end

  test "round-trips random terms (seeded property test)" do
    :rand.seed(:exsss, {1, 2, 3})

    for _ <- 1..3_000 do
      term = random_term(3)
      assert {:ok, iodata} = Msgpack.encode(term)
      assert Msgpack.decode(IO.iodata_to_binary(iodata)) == {:ok, term}
    end
  end

  test "bad input is an error value, never a crash" do
    assert Msgpack.decode(<<0xC1>>) == {:error, :unsupported_type}
    assert Msgpack.decode(<<0x92, 0x01>>) == {:error, :truncated}
    assert Msgpack.decode(<<0x01, 0x02>>) == {:error, :trailing_bytes}
    assert Msgpack.decode(<<0xA5, "abc">>) == {:error, :truncated}
    assert Msgpack.decode(<<0xD4, 1, 2>>) == {:error, :unsupported_type}
    assert {:error, {:unsupported, {:a, :tuple}, _, []}} = Msgpack.encode({:a, :tuple})

    :rand.seed(:exsss, {4, 5, 6})

    for _ <- 1..3_000 do
      garbage = for _ <- 1..:rand.uniform(12), into: <<>>, do: <<:rand.uniform(256) - 1>>
      assert match?({:ok, _}, Msgpack.decode(garbage)) or match?({:error, _}, Msgpack.decode(garbage))
    end
  end

  test "NaN and the infinities, which the BEAM has no float for, decode as atoms in their place" do
    assert Msgpack.decode(<<0x93, 0xCB, 0x7FF8::16, 0::48, 0xCB, 0x7FF0::16, 0::48, 0xCA, 0xFF80::16, 0::16>>) ==
             {:ok, [:nan, :infinity, :neg_infinity]}

    assert Msgpack.decode(<<0x81, 0xA1, "x", 0xCA, 0x7FC0::16, 1::16>>) == {:ok, %{"x" => :nan}}
    assert Msgpack.decode(<<0xCB, 0x7FF0::16, 0::40>>) == {:error, :truncated}
  end

  test "what msgpack cannot carry is refused with where it is, never sent as another value" do
    # 2^64 once went out as one signed byte (0), 2^64 + 200 as -56
    for n <- [1 <<< 64, (1 <<< 64) + 200, -(1 <<< 63) - 1, 1 <<< 100] do
      assert {:error, {:unsupported, ^n, why, ["max_new_tokens"]}} =
               Msgpack.encode(%{"max_new_tokens" => n, "id" => 1})

      assert why =~ "range"
    end

    assert {:ok, _} = Msgpack.encode([(1 <<< 64) - 1, -(1 <<< 63)])
    latin1 = "caf" <> <<0xE9>>

    assert {:error, {:unsupported, ^latin1, why, ["messages", 1, "content"]}} =
             Msgpack.encode(%{"messages" => [%{"content" => "ok"}, %{"content" => latin1}]})

    assert why =~ "UTF-8"
    assert {:ok, _} = Msgpack.encode(%Msgpack.Bin{data: latin1})
  end

  test "entries put in front of an encoded map make one map, whatever header its new size needs" do
    for n <- [0, 2, 13, 14, 15, 65_533, 65_534, 65_535] do
      map = Map.new(1..n//1, fn i -> {"k#{i}", i} end)
      {:ok, body} = Msgpack.encode(map)

      assert {:ok, iodata} = Msgpack.prepend_entries(IO.iodata_to_binary(body), [{"id", 7}, {"op", "ping"}])

      assert Msgpack.decode(IO.iodata_to_binary(iodata)) ==
               {:ok, Map.merge(map, %{"id" => 7, "op" => "ping"})}
    end

    assert Msgpack.prepend_entries(<<0x91, 0x01>>, [{"id", 7}]) == :error
  end

  test "an improper list is refused with where it is" do
    assert {:error, {:unsupported, [1 | 2], "an improper list", ["stop"]}} =
             Msgpack.encode(%{"stop" => [1 | 2]})
  end

  defp random_term(0), do: random_scalar()

  defp random_term(depth) do
    case :rand.uniform(6) do
      1 -> for _ <- 1..:rand.uniform(4), do: random_term(depth - 1)
      2 -> Map.new(1..:rand.uniform(4), fn _ -> {random_string(), random_term(depth - 1)} end)
      _ -> random_scalar()
    end
  end

  defp random_scalar do
    case :rand.uniform(8) do
      1 -> nil
      2 -> :rand.uniform(2) == 1
      3 -> :rand.uniform(1 <<< 64) - 1
      4 -> -:rand.uniform(1 <<< 63)
      5 -> (:rand.uniform() - 0.5) * 1.0e6
      6 -> random_string()
      7 -> %Msgpack.Bin{data: :crypto.strong_rand_bytes(:rand.uniform(300) - 1)}
      8 -> Enum.at([0, 127, 128, 255, 256, 65535, 65536, -32, -33, -128, -129], :rand.uniform(11) - 1)
    end
  end

  defp random_string do
    Enum.at(
      ["", "a", "héllo", String.duplicate("x", 40), String.duplicate("é", 200), "日本"],
      :rand.uniform(6) - 1
    )
  end
end
