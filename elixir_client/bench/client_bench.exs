# The Elixir client over the Port, against the Python API in the same run.
#
#     cd elixir_client && MIX_ENV=test mix run bench/client_bench.exs [pings] [tokens] [rounds]
#
# 1. ping round trip from Elixir through the Port: p50 and p99.
# 2. one long streamed generation received by an Elixir process vs the same generation through the
#    Python API (bench/python_api_generate.py), alternating, median of the rounds.

[pings, tokens, rounds] =
  case System.argv() do
    [p, t, r] -> Enum.map([p, t, r], &String.to_integer/1)
    _ -> [5_000, 1_500, 5]
  end

opts = Sidecar.Test.Helpers.sidecar_opts()
python = opts[:python]
root = Sidecar.Test.Helpers.root()
{:ok, conn} = Sidecar.start_link(opts)
median = fn list -> list |> Enum.sort() |> Enum.at(div(length(list), 2)) end
pct = fn list, q -> list |> Enum.sort() |> Enum.at(min(length(list) - 1, trunc(q * length(list)))) end

for _ <- 1..200, do: :ok = Sidecar.ping(conn)

rtts =
  for _ <- 1..pings do
    t = System.monotonic_time(:nanosecond)
    :ok = Sidecar.ping(conn)
    System.monotonic_time(:nanosecond) - t
  end

{:ok, session} = Sidecar.open_session(conn)
Sidecar.generate(conn, session, [5, 6], max_new_tokens: 8, eos_token_id: [])

python_run = fn ->
  {out, 0} =
    System.cmd(python, ["bench/python_api_generate.py", Integer.to_string(tokens)],
      cd: root,
      env: opts[:env],
      stderr_to_stdout: false
    )

  [_, seconds] = Regex.run(~r/"seconds": ([0-9.e-]+)/, out)
  String.to_float(seconds)
end

elixir_run = fn ->
  {:ok, s} = Sidecar.open_session(conn)
  t = System.monotonic_time(:nanosecond)

  ^tokens =
    Sidecar.stream(conn, s, [5, 6], max_new_tokens: tokens, eos_token_id: [], timeout: 120_000)
    |> Enum.count()

  seconds = (System.monotonic_time(:nanosecond) - t) / 1.0e9
  :ok = Sidecar.close_session(conn, s)
  seconds
end

{elixir_times, python_times} =
  Enum.reduce(1..rounds, {[], []}, fn _, {e, p} -> {[elixir_run.() | e], [python_run.() | p]} end)

e = median.(elixir_times)
p = median.(python_times)

IO.puts("""

Elixir client through the Port (default model, #{pings} pings, #{tokens}-token streamed generation, median of #{rounds})
measure                                     value
------------------------------------------  ------------
ping round trip p50                         #{Float.round(median.(rtts) / 1000, 1)} us
ping round trip p99                         #{Float.round(pct.(rtts, 0.99) / 1000, 1)} us
tokens/s received by an Elixir process      #{round(tokens / e)}
tokens/s through the Python API             #{round(tokens / p)}
overhead of the Elixir path                 #{Float.round((e / p - 1) * 100, 2)} %   (target <= 5 %)
""")

GenServer.stop(conn)
