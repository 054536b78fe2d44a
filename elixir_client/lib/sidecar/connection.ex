defmodule Sidecar.Connection do
  @moduledoc false
  # The one process that owns the Port to the Python sidecar (and, optionally, the port that reads
  # its stderr). Requests are asynchronous here: the caller gets `{Sidecar, ref, {:event, map}}`
  # messages and one `{Sidecar, ref, {:reply, result}}`. `Sidecar` turns that into blocking calls,
  # lazy streams and timeouts.

  use GenServer
  require Logger

  alias Sidecar.{Error, Protocol}

  defstruct [:port, :os_pid, :codec, :incarnation, :hello, :log_port, :fifo, next_id: 1, pending: %{}]

  @hello_id 0

  def start_link(opts) do
    {name, opts} = Keyword.pop(opts, :name)
    GenServer.start_link(__MODULE__, opts, if(name, do: [name: name], else: []))
  end

  # ---- startup ----------------------------------------------------------------------------------

  @impl true
  def init(opts) do
    Process.flag(:trap_exit, true)
    {log_port, fifo} = if opts[:log_stderr], do: open_stderr_reader(), else: {nil, nil}
    port = open_sidecar(opts, fifo)

    state = %__MODULE__{
      port: port,
      os_pid: port_os_pid(port),
      codec: opts[:codec],
      log_port: log_port,
      fifo: fifo
    }

    send_message(state, Protocol.request(@hello_id, "hello", %{}))

    case await_hello(state, deadline(opts[:startup_timeout])) do
      {:ok, hello} ->
        if fifo, do: File.rm(fifo)
        {:ok, %{state | hello: hello, incarnation: make_ref()}}

      {:error, error} ->
        if Port.info(port), do: Port.close(port)
        drain_stderr(log_port)
        if fifo, do: File.rm(fifo)
        {:stop, error}
    end
  end

  defp open_sidecar(opts, fifo) do
    model_args =
      case opts[:model] do
        nil -> []
        :default -> ["--model", "default"]
        path -> ["--model", path]
      end

    args =
      ["-m", "sidecar", "--fds", "3,4"] ++
        model_args ++ if(fifo, do: ["--stderr", fifo], else: []) ++ opts[:args]

    env = for {k, v} <- opts[:env], do: {String.to_charlist(k), String.to_charlist(v)}
    port_opts = [:binary, {:packet, 4}, :exit_status, :nouse_stdio, args: args, env: env]

    Port.open(
      {:spawn_executable, opts[:python]},
      if(opts[:cd], do: [{:cd, opts[:cd]} | port_opts], else: port_opts)
    )
  end

  # The child's stderr is the BEAM's own with :nouse_stdio, so the sidecar writes it into a FIFO
  # that `cat` relays to us line by line.
  defp open_stderr_reader do
    fifo =
      Path.join(System.tmp_dir!(), "sidecar-stderr-#{System.unique_integer([:positive])}-#{:os.getpid()}")

    with {_, 0} <- System.cmd("mkfifo", ["-m", "600", fifo], stderr_to_stdout: true),
         cat when is_binary(cat) <- System.find_executable("cat") do
      {Port.open({:spawn_executable, cat}, [:binary, {:line, 16_384}, :exit_status, args: [fifo]]), fifo}
    else
      _ ->
        Logger.warning("Sidecar: cannot create a FIFO for the sidecar's stderr; it goes to the BEAM's stderr")
        {nil, nil}
    end
  end

  defp port_os_pid(port) do
    case Port.info(port, :os_pid) do
      {:os_pid, pid} -> pid
      _ -> nil
    end
  end

  defp await_hello(%{port: port, log_port: log_port} = state, deadline) do
    receive do
      {^port, {:data, payload}} ->
        case decode(state, payload) do
          {:reply, @hello_id, {:ok, hello}} -> {:ok, hello}
          {:reply, @hello_id, {:error, error}} -> {:error, Error.from_reply(error)}
          _other -> await_hello(state, deadline)
        end

      {^port, {:exit_status, status}} ->
        {:error,
         Error.new(:sidecar_exited, "the sidecar exited with status #{status} during startup", %{
           status: status
         })}

      {^log_port, {:data, line}} ->
        log_line(line)
        await_hello(state, deadline)
    after
      remaining(deadline) ->
        {:error, Error.new(:timeout, "the sidecar did not answer hello in time (startup_timeout)")}
    end
  end

  # After the sidecar is gone, `cat` relays its last lines and exits by itself on the FIFO's EOF.
  defp drain_stderr(nil), do: :ok

  defp drain_stderr(log_port) do
    receive do
      {^log_port, {:data, line}} -> log_line(line) && drain_stderr(log_port)
      {^log_port, {:exit_status, _}} -> :ok
    after
      1_000 -> if Port.info(log_port), do: Port.close(log_port)
    end
  end

  defp deadline(:infinity), do: :infinity
  defp deadline(ms), do: System.monotonic_time(:millisecond) + ms
  defp remaining(:infinity), do: :infinity
  defp remaining(deadline), do: max(0, deadline - System.monotonic_time(:millisecond))

  # ---- requests ---------------------------------------------------------------------------------

  @impl true
  def handle_call({:request, op, params, incarnation}, {caller, _}, state) do
    if incarnation != nil and incarnation != state.incarnation do
      {:reply, {:error, Error.new(:session_lost, "the session belonged to a sidecar that has since exited")},
       state}
    else
      id = state.next_id
      ref = make_ref()

      case send_message(state, Protocol.request(id, op, params)) do
        :ok ->
          entry = %{caller: caller, ref: ref, monitor: Process.monitor(caller), op: op}
          {:reply, {:ok, ref, id}, %{state | next_id: id + 1, pending: Map.put(state.pending, id, entry)}}

        {:error, error} ->
          {:reply, {:error, error}, %{state | next_id: id + 1}}
      end
    end
  end

  def handle_call(:info, _from, state) do
    {:reply, Map.merge(state.hello, %{"os_pid" => state.os_pid, "incarnation" => state.incarnation}), state}
  end

  @impl true
  def handle_cast({:cancel, target}, state), do: {:noreply, cancel_on_server(state, target)}

  def handle_cast({:forget, id}, state) do
    case Map.pop(state.pending, id) do
      {nil, _} ->
        {:noreply, state}

      {entry, pending} ->
        Process.demonitor(entry.monitor, [:flush]) && {:noreply, %{state | pending: pending}}
    end
  end

  defp cancel_on_server(state, target) do
    id = state.next_id
    send_message(state, Protocol.request(id, "cancel", %{"target" => target}))
    # Nobody waits for the cancel's own reply: a placeholder entry makes it be dropped quietly.
    %{
      state
      | next_id: id + 1,
        pending: Map.put(state.pending, id, %{caller: nil, ref: nil, monitor: nil, op: "cancel"})
    }
  end

  # ---- incoming ---------------------------------------------------------------------------------

  @impl true
  def handle_info({port, {:data, payload}}, %{port: port} = state) do
    case decode(state, payload) do
      {:event, id, event} ->
        with %{caller: caller, ref: ref} when caller != nil <- state.pending[id],
             do: send(caller, {Sidecar, ref, {:event, event}})

        {:noreply, state}

      {:reply, id, result} ->
        {:noreply, deliver(state, id, result)}

      {:unattributed, error} ->
        Logger.warning(
          "Sidecar: the sidecar could not attribute a message: #{error["code"]}: #{error["message"]}"
        )

        {:noreply, state}

      {:invalid, what} ->
        Logger.error("Sidecar: unreadable message from the sidecar: #{inspect(what, limit: 20)}")
        {:noreply, state}
    end
  end

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    error = Error.new(:sidecar_exited, "the sidecar exited with status #{status}", %{status: status})

    for {_id, %{caller: caller, ref: ref}} <- state.pending, caller != nil do
      send(caller, {Sidecar, ref, {:reply, {:error, error}}})
    end

    drain_stderr(state.log_port)
    {:stop, {:shutdown, {:sidecar_exited, status}}, %{state | pending: %{}, port: nil, log_port: nil}}
  end

  def handle_info({log_port, {:data, line}}, %{log_port: log_port} = state) do
    log_line(line)
    {:noreply, state}
  end

  def handle_info({log_port, {:exit_status, _}}, %{log_port: log_port} = state),
    do: {:noreply, %{state | log_port: nil}}

  def handle_info({:DOWN, monitor, :process, _pid, _reason}, state) do
    # A caller died: forget its requests and cancel its generations, which nobody will read.
    {gone, kept} = Enum.split_with(state.pending, fn {_id, entry} -> entry.monitor == monitor end)
    state = %{state | pending: Map.new(kept)}

    state =
      Enum.reduce(gone, state, fn
        {id, %{op: "generate"}}, acc -> cancel_on_server(acc, id)
        _, acc -> acc
      end)

    {:noreply, state}
  end

  def handle_info({:EXIT, _port, _reason}, state), do: {:noreply, state}

  defp deliver(state, id, result) do
    case Map.pop(state.pending, id) do
      {nil, _} ->
        state

      {%{caller: nil}, pending} ->
        %{state | pending: pending}

      {%{caller: caller, ref: ref, monitor: monitor}, pending} ->
        Process.demonitor(monitor, [:flush])
        send(caller, {Sidecar, ref, {:reply, reply_value(result)}})
        %{state | pending: pending}
    end
  end

  defp reply_value({:ok, result}), do: {:ok, result}
  defp reply_value({:error, error}), do: {:error, Error.from_reply(error)}

  @impl true
  def terminate(_reason, state) do
    if state.port && Port.info(state.port), do: Port.close(state.port)
    drain_stderr(state.log_port)
    if state.fifo, do: File.rm(state.fifo)
    :ok
  end

  # ---- codec ------------------------------------------------------------------------------------

  defp send_message(state, message) do
    case state.codec.encode(message) do
      {:ok, payload} ->
        Port.command(state.port, payload)
        :ok

      {:error, reason} ->
        {:error, Error.new(:invalid_argument, "cannot encode the request: #{inspect(reason)}")}
    end
  end

  defp decode(state, payload) do
    case state.codec.decode(payload) do
      {:ok, message} -> Protocol.classify(message)
      {:error, reason} -> {:invalid, {:undecodable, reason}}
    end
  end

  defp log_line({_eol_or_noeol, line}) do
    level =
      cond do
        line =~ ~r/\b(ERROR|CRITICAL)\b/ -> :error
        line =~ ~r/\bWARNING\b/ -> :warning
        line =~ ~r/\bDEBUG\b/ -> :debug
        true -> :info
      end

    Logger.log(level, "[sidecar] " <> line)
  end
end
