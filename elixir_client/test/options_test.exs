defmodule Sidecar.OptionsTest do
  use ExUnit.Case, async: true

  test "start options are validated before anything starts" do
    assert_raise ArgumentError, ~r/unknown Sidecar start option :modle; valid options: :python, :model/, fn ->
      Sidecar.start_link(modle: "x")
    end

    assert_raise ArgumentError, ~r/invalid value -1 for Sidecar option :call_timeout/, fn ->
      Sidecar.start_link(call_timeout: -1)
    end

    assert_raise ArgumentError, ~r/option :python: executable "no-such-python" not found/, fn ->
      Sidecar.start_link(python: "no-such-python")
    end

    assert_raise ArgumentError, ~r/does not implement Sidecar.Codec/, fn ->
      Sidecar.start_link(codec: String)
    end

    assert_raise ArgumentError, ~r/option :env/, fn -> Sidecar.start_link(env: [{"A", 1}]) end

    assert_raise ArgumentError, ~r/invalid value 7 for Sidecar option :device/, fn ->
      Sidecar.start_link(device: 7)
    end
  end

  test ":device and :dtype become the sidecar's --device and --dtype flags" do
    assert Sidecar.Options.flags(device: "cuda:1", dtype: :bf16) == ["--device", "cuda:1", "--dtype", "bf16"]
    assert Sidecar.Options.flags(device: nil, dtype: nil) == []
  end

  test "child_spec uses the name as id" do
    assert %{id: MyApp.Sidecar, start: {Sidecar, :start_link, [[name: MyApp.Sidecar]]}} =
             Sidecar.child_spec(name: MyApp.Sidecar)
  end
end
