defmodule Sidecar.Test.Helpers do
  @moduledoc false

  @root Path.expand("../../..", __DIR__)

  def root, do: @root

  @doc "Start options for a real sidecar with the tiny default model, from the repository's .venv."
  def sidecar_opts(extra \\ []) do
    python = System.get_env("SIDECAR_PYTHON") || Path.join(@root, ".venv/bin/python")
    cache = System.get_env("SIDECAR_CACHE_DIR") || Path.join(@root, "elixir_client/_build/model-cache")
    Keyword.merge([python: python, model: :default, cd: @root, env: [{"SIDECAR_CACHE_DIR", cache}]], extra)
  end

  @doc "Golden vectors of the protocol, as decoded JSON."
  def vectors(name),
    do: Path.join([@root, "protocol", "vectors", name]) |> File.read!() |> Sidecar.Test.JSON.decode!()

  @doc "A vector value as Elixir terms: {\"$bin\": hex} is bin, {\"$float\": x} a float."
  def from_json(%{"$bin" => hex}), do: %Sidecar.Msgpack.Bin{data: Base.decode16!(hex, case: :lower)}
  def from_json(%{"$float" => x}), do: x * 1.0
  def from_json(%{} = map), do: Map.new(map, fn {k, v} -> {k, from_json(v)} end)
  def from_json(list) when is_list(list), do: Enum.map(list, &from_json/1)
  def from_json(value), do: value

  def os_alive?(os_pid),
    do: match?({_, 0}, System.cmd("kill", ["-0", Integer.to_string(os_pid)], stderr_to_stdout: true))

  def eventually(fun, timeout \\ 5_000) do
    deadline = System.monotonic_time(:millisecond) + timeout

    Stream.repeatedly(fn -> fun.() || (Process.sleep(20) && false) end)
    |> Enum.find(fn ok -> ok || System.monotonic_time(:millisecond) > deadline end)
  end
end
