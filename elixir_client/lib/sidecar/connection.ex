defmodule Sidecar.Connection do
  @moduledoc false
  # The one process that owns the Port to the Python sidecar (and, optionally, the relay of its
  # stderr). Requests are asynchronous here: the caller hands in `ref`, an alias of itself, and gets
  # `{Sidecar, ref, {:event, map}}` messages and one `{Sidecar, ref, {:reply, result}}` sent to that
  # alias. `Sidecar` turns that into blocking calls, lazy streams and timeouts; a caller that gives up
  # deactivates its alias, so whatever is sent after that never reaches its mailbox.
  #
  # Frames wait in an outbox until the Port takes them without suspending this process: a sidecar
  # that stops reading (backpressure) leaves them there, and the connection keeps answering. A
  # request withdrawn or cancelled while still in the outbox is never sent.

  use GenServer
  require Logger

  alias Sidecar.{Error, Protocol}

  defstruct [
    :port,
    :os_pid,
    :codec,
    :call_timeout,
    :incarnation,
    :hello,
    :relay,
    next_id: 1,
    pending: %{},
    outbox: :queue.new(),
    outbox_bytes: 0,
    retrying: false,
    made: %{},
    owned: %{}
  ]

  @hello_id 0

  # Requests that make a session: when their caller stopped waiting, the session made is closed.
  @making_sessions ["open_session", "fork_session", "restore_session"]

  @doc false
  # Whether `op` makes a session, which its caller claims once it has the reply (`{:claimed, ref}`).
  def makes_session?(op), do: op in @making_sessions

  # The `stats` of a generation that ran nothing (cancelled before it was sent), as the sidecar gives
  # those of one cancelled before it started.
  @nothing_run %{
    "prompt_tokens" => 0,
    "reused_tokens" => 0,
    "shared_tokens" => 0,
    "shifted_tokens" => 0,
    "prefill_tokens" => 0,
    "generated_tokens" => 0,
    "ttft_s" => nil,
    "total_s" => 0.0
  }

  # How long we relay the last lines of a sidecar that is going away: it exits on the EOF of its
  # input, then `cat` relays what is left and exits on the EOF of the FIFO. A `cat` still running
  # past this ends with the sidecar, quietly.
  @relay_drain_ms 3_000

  # Stderr lines kept from startup for the error of a failed start: an argparse usage text or a
  # Python traceback fits.
  @startup_tail_lines 40

  # How soon the outbox is tried again once the Port was busy.
  @retry_ms 5

  def start_link(opts) do
    {name, opts} = Keyword.pop(opts, :name)
    GenServer.start_link(__MODULE__, opts, if(name, do: [name: name], else: []))
  end

  def start(opts) do
    {name, opts} = Keyword.pop(opts, :name)
    GenServer.start(__MODULE__, opts, if(name, do: [name: name], else: []))
  end

  # ---- startup ----------------------------------------------------------------------------------

  @impl true
  def init(opts) do
    Process.flag(:trap_exit, true)
    relay = if opts[:log_stderr], do: open_relay()
    port = open_sidecar(opts, relay)

    state = %__MODULE__{
      port: port,
      os_pid: port_os_pid(port),
      codec: opts[:codec],
      call_timeout: opts[:call_timeout],
      relay: relay
    }

    {:ok, state} = send_message(state, Protocol.request(@hello_id, "hello", %{}))

    case await_hello(state, deadline(opts[:startup_timeout]), []) do
      {:ok, hello} ->
        {:ok, %{state | hello: hello, incarnation: make_ref()}}

      {:error, failure, tail} ->
        # A sidecar still loading would only notice its closed input once loaded: stop it now.
        if close_port(port), do: kill(state.os_pid)

        tail = Enum.take(close_relay(relay) ++ tail, @startup_tail_lines) |> Enum.reverse()
        {:stop, startup_error(failure, tail, opts[:python], relay != nil)}
    end
  end

  defp open_sidecar(opts, relay) do
    model_args =
      case opts[:model] do
        nil -> []
        :default -> ["--model", "default"]
        path -> ["--model", path]
      end

    args = ["-m", "sidecar", "--fds", "3,4"] ++ model_args ++ Sidecar.Options.flags(opts) ++ opts[:args]
    env = for {k, v} <- opts[:env], do: {String.to_charlist(k), String.to_charlist(v)}
    port_opts = [:binary, {:packet, 4}, :exit_status, :nouse_stdio, env: env]
    port_opts = if opts[:cd], do: [{:cd, opts[:cd]} | port_opts], else: port_opts

    case relay do
      nil ->
        Port.open({:spawn_executable, opts[:python]}, [{:args, args} | port_opts])

      # A Port cannot redirect the stderr of a :nouse_stdio child, so a shell does it and then
      # becomes Python (same OS pid): Python's stderr is the FIFO from its first line on, and even
      # an argparse error or a failed import reaches us. The FIFO is the script's $0, removed once
      # open (`cat` and we hold it too): a connection killed while the sidecar starts leaves no FIFO.
      # It is opened for reading and writing first, an open that never waits (were `cat` gone, this
      # process killed, the shell would wait in open() for ever, holding the BEAM's stdout), and then
      # for writing only, which that first end lets through at once: the sidecar holds no reading end,
      # so its writes fail instead of blocking once `cat` is gone.
      %{sh: sh, fifo: fifo} ->
        script = ~S(exec 2<>"$0" 2>"$0"; rm -f "$0"; exec "$@")
        Port.open({:spawn_executable, sh}, [{:args, ["-c", script, fifo, opts[:python] | args]} | port_opts])
    end
  end

  # The child's stderr is the BEAM's own with :nouse_stdio, so the sidecar writes it into a FIFO
  # that `cat` relays to us line by line. We hold the FIFO open for reading and writing (unlike a
  # read-only or write-only open, that does not wait for the other side), so `cat` and the
  # sidecar's shell open it at once. Before the sidecar starts, `cat` must have opened it: we send an
  # empty line through and wait for it to come back. Otherwise a sidecar that fails at once could
  # have us close our end first, which loses what it wrote (a FIFO's data goes with its last open
  # end) and leaves `cat` blocked in open() for ever. After that, `cat` meets its EOF only once the
  # sidecar has exited and we have closed our end, having relayed every line. If this process dies,
  # the runtime closes our end all the same. `cat`'s own stderr goes into its port too, so a `cat`
  # that outlives the port ends quietly instead of printing "write error: Broken pipe" on the
  # BEAM's stderr. The FIFO is made, and removed, by the shell that runs `cat`, so that a connection
  # killed at any moment of its start leaves no FIFO behind (made here, it would stay when this process
  # is killed before the shell starts). The shell holds it open for reading and writing, an open that
  # never waits, and says so with an empty line; once we hold our end too (a line on its stdin), it
  # opens it for reading only as `cat`'s stdin, which our end lets through at once, and lets go of its
  # own: `cat` meets EOF once every writer is gone. Were this process killed before, the shell reads
  # EOF instead of that line and removes the FIFO; `cat` never waits in open() for a writer that is
  # gone. SIGPIPE is ignored while the shell may write to a port that is gone.
  defp open_relay do
    fifo =
      Path.join(System.tmp_dir!(), "sidecar-stderr-#{System.unique_integer([:positive])}-#{:os.getpid()}")

    with cat when is_binary(cat) <- System.find_executable("cat"),
         sh when is_binary(sh) <- System.find_executable("sh") do
      start_relay(fifo, sh, cat)
    else
      _ -> no_relay(fifo)
    end
  end

  defp start_relay(fifo, sh, cat) do
    script =
      ~S(trap '' PIPE; mkfifo -m 600 "$0" || exit 1; exec 3<>"$0"; echo; read _ || { rm -f "$0"; exit 1; }; ) <>
        ~S(exec 0<"$0" 3<&-; trap - PIPE; "$1"; rm -f "$0")

    port_opts = [:binary, {:line, 16_384}, :exit_status, :stderr_to_stdout, args: ["-c", script, fifo, cat]]
    port = Port.open({:spawn_executable, sh}, port_opts)

    with :ok <- fifo_made(port),
         {:ok, writer} <- File.open(fifo, [:read, :write, :raw]),
         true <- port_command(port, "\n"),
         relay = %{port: port, fifo: fifo, writer: writer, sh: sh},
         :ok <- relay_ready(relay) do
      relay
    else
      _ ->
        # its shell, if still waiting for our line, reads EOF and removes the FIFO
        close_port(port)
        no_relay(fifo)
    end
  end

  defp no_relay(fifo) do
    File.rm(fifo)
    Logger.warning("Sidecar: cannot relay the sidecar's stderr through a FIFO; it goes to the BEAM's stderr")
    nil
  end

  # The relay's first line, empty, once its shell has made the FIFO; a shell that fails (mkfifo) exits.
  defp fifo_made(port) do
    receive do
      {^port, {:data, {:eol, ""}}} ->
        :ok

      {^port, {:exit_status, _}} ->
        :error
    after
      @relay_drain_ms ->
        kill(port_os_pid(port))
        close_port(port)
        :error
    end
  end

  defp relay_ready(%{port: cat, writer: writer} = relay) do
    :ok = :file.write(writer, "\n")

    receive do
      {^cat, {:data, {:eol, ""}}} ->
        :ok

      {^cat, {:exit_status, _}} ->
        close_relay(relay)
        :error
    after
      @relay_drain_ms ->
        kill(port_os_pid(cat))
        close_relay(relay)
        :error
    end
  end

  # Once the sidecar has exited (or its Port is closed), our end is the last thing keeping the FIFO
  # from `cat`'s EOF. Returns the lines relayed meanwhile, the last first.
  defp close_relay(nil), do: []

  defp close_relay(%{port: cat, fifo: fifo, writer: writer}) do
    File.close(writer)
    lines = drain_relay(cat, deadline(@relay_drain_ms), [])
    File.rm(fifo)
    lines
  end

  defp drain_relay(cat, deadline, lines) do
    receive do
      {^cat, {:data, line}} -> drain_relay(cat, deadline, [log_line(line) | lines])
      {^cat, {:exit_status, _}} -> lines
    after
      remaining(deadline) ->
        close_port(cat)
        lines
    end
  end

  # A port closes on its own once its program exits, which can happen between any check of
  # Port.info and the close: Port.close then raises (badarg). A port already closed is what we want.
  # True when this closed it, so its program may still run.
  defp close_port(port) do
    Port.close(port)
  rescue
    ArgumentError -> false
  end

  defp port_os_pid(port) do
    case Port.info(port, :os_pid) do
      {:os_pid, pid} -> pid
      _ -> nil
    end
  end

  defp kill(nil), do: :ok

  defp kill(os_pid) do
    System.cmd("kill", ["-KILL", Integer.to_string(os_pid)], stderr_to_stdout: true)
    :ok
  end

  # The hello reply, or why there is none with the stderr lines relayed so far (the last first).
  defp await_hello(%{port: port, relay: relay} = state, deadline, tail) do
    cat = relay && relay.port

    receive do
      {^port, {:data, payload}} ->
        case decode(state, payload) do
          {:reply, @hello_id, {:ok, hello}} -> {:ok, hello}
          {:reply, @hello_id, {:error, error}} -> {:error, {:refused, error}, tail}
          _other -> await_hello(state, deadline, tail)
        end

      {^port, {:exit_status, status}} ->
        {:error, {:exited, status}, tail}

      {^cat, {:data, line}} ->
        await_hello(state, deadline, Enum.take([log_line(line) | tail], @startup_tail_lines))
    after
      remaining(deadline) -> {:error, :timeout, tail}
    end
  end

  # The error of a failed start, its message naming the cause as the sidecar printed it; `details`
  # carry the last lines of its stderr as one string.
  defp startup_error({:refused, error}, _tail, _python, _relayed?), do: Error.from_reply(error)

  defp startup_error(:timeout, tail, _python, _relayed?) do
    Error.new(:timeout, "the sidecar did not answer hello in time (startup_timeout)", %{
      stderr: Enum.join(tail, "\n")
    })
  end

  defp startup_error({:exited, status}, tail, python, relayed?) do
    message = "the sidecar exited with status #{status} during startup"
    last_first = Enum.reverse(tail)

    cause =
      cond do
        missing = Enum.find_value(last_first, &missing_module/1) ->
          "#{python} #{missing}: set the :python option to the Python of the virtualenv the sidecar " <>
            ~s(is installed in, e.g. python: "/path/to/.venv/bin/python")

        line = Enum.find(last_first, &(&1 =~ ~r/\berror\b|Error\b|\bERROR\b|\bCRITICAL\b/)) ->
          strip_log_prefix(line)

        status == 0 ->
          "it ended without serving: an argument such as --help or --version prints (to its " <>
            "stdout, the BEAM's own) and exits"

        line = Enum.find(last_first, &(String.trim(&1) != "")) ->
          strip_log_prefix(line)

        relayed? ->
          nil

        true ->
          "its stderr went to the BEAM's stderr (log_stderr: false)"
      end

    Error.new(:sidecar_exited, if(cause, do: "#{message}: #{cause}", else: message), %{
      status: status,
      stderr: Enum.join(tail, "\n")
    })
  end

  # `python -m sidecar` without the package prints "python3: No module named sidecar"; an import
  # that fails later (the package found in the working directory, a dependency missing) raises
  # "ModuleNotFoundError: No module named 'torch'".
  defp missing_module(line) do
    case Regex.run(~r/No module named '?([\w.]+)'?/, line) do
      [said, "sidecar"] -> "has no sidecar package (#{said})"
      [said, _dependency] -> "lacks a module the sidecar needs (#{said})"
      nil -> nil
    end
  end

  # "2026-01-01 12:00:00,000 ERROR sidecar: cannot load ..." -> "cannot load ..."
  defp strip_log_prefix(line),
    do: String.replace(line, ~r/^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ [\w.]+: /, "")

  defp deadline(:infinity), do: :infinity
  defp deadline(ms), do: System.monotonic_time(:millisecond) + ms
  defp remaining(:infinity), do: :infinity
  defp remaining(deadline), do: max(0, deadline - System.monotonic_time(:millisecond))

  # ---- requests ---------------------------------------------------------------------------------

  # What a request says of a session's owner (see take_request): anything else is a call we refuse.
  defguardp session_owner?(o)
            when o == nil or
                   (is_tuple(o) and tuple_size(o) == 2 and
                      ((elem(o, 0) == :owner and is_pid(elem(o, 1))) or
                         (elem(o, 0) == :closing and is_binary(elem(o, 1)))))

  @impl true
  def handle_call({:request, op, params, incarnation, ref, session_owner}, {caller, _}, state)
      when session_owner?(session_owner) do
    if incarnation != nil and incarnation != state.incarnation do
      {:reply,
       {:error,
        Error.new(
          :session_lost,
          "the session belongs to another connection, or to a sidecar that has since exited"
        )}, state}
    else
      take_request(op, params, ref, caller, session_owner, state)
    end
  end

  # The codec a caller encodes its request with: a request of many megabytes is encoded by the process
  # that sends it, not here, where it would hold back every other caller.
  def handle_call(:encoding, _from, state),
    do: {:reply, %{codec: state.codec, max_depth: get_in(state.hello, ["limits", "max_depth"])}, state}

  def handle_call({:pending?, id}, _from, state), do: {:reply, Map.has_key?(state.pending, id), state}

  def handle_call(:info, _from, state) do
    {:reply, Map.merge(state.hello, %{"os_pid" => state.os_pid, "incarnation" => state.incarnation}), state}
  end

  # Calls and casts that are none of ours (a stray GenServer.call or cast to a named connection) are
  # refused and dropped, not a crash of the connection and of its sidecar's sessions with it.
  def handle_call(request, _from, state) do
    Logger.warning("Sidecar: the connection refused an unexpected call: #{inspect(request, limit: 10)}")
    {:reply, {:error, Error.new(:invalid_argument, "not a call the Sidecar connection knows")}, state}
  end

  # `session_owner`: the process whose exit closes the session a request makes (`{:owner, pid}`), or
  # the session a close_session closes (`{:closing, name}`), which no exit closes from then on: an exit
  # coming later would close, by its name, whatever session has the name by then (one opened since).
  # A close withdrawn before it was sent is still sent (`abandon`), since nothing else would close it.
  defp take_request(op, body, ref, caller, session_owner, state) do
    id = state.next_id

    case queue_request(state, id, op, body) do
      {:ok, state} ->
        state = with {:closing, name} <- session_owner, do: disown(state, name), else: (_ -> state)
        entry = %{ref: ref, monitor: Process.monitor(caller), op: op, owner: session_owner}

        {:reply, {:ok, id, state.call_timeout},
         %{state | next_id: id + 1, pending: Map.put(state.pending, id, entry)}}

      {:error, error} ->
        {:reply, {:error, error}, %{state | next_id: id + 1}}
    end
  end

  @impl true
  def handle_cast({:cancel, target}, state), do: {:noreply, cancel_on_server(state, target)}

  # A caller that stopped waiting (its alias `ref` is gone): a request still unsent is not sent at all;
  # a generation already sent is cancelled, since nobody will read it.
  # A session made for it and relayed as the caller gave up (dropped at its deactivated alias, the caller
  # says: `replied` false) is closed too; one whose reply it found is its own (as `:claimed` says).
  def handle_cast({:withdraw, ref, replied}, state) do
    case Enum.find(state.pending, fn {_id, entry} -> entry.ref == ref end) do
      nil -> {:noreply, unclaimed(state, ref, not replied)}
      {id, entry} -> {:noreply, state |> forget_pending(id) |> abandon(id, entry)}
    end
  end

  # The caller of a request that made a session has its reply.
  def handle_cast({:claimed, ref}, state), do: {:noreply, unclaimed(state, ref, false)}

  def handle_cast(request, state) do
    Logger.warning("Sidecar: the connection ignored an unexpected cast: #{inspect(request, limit: 10)}")
    {:noreply, state}
  end

  # A request nobody will read (its entry already out of `pending`): still unsent, it never is; a
  # generation already sent is cancelled; a session it makes is closed once made (nobody would know its
  # name, and it would count against max_sessions for good); anything else runs, its reply dropped.
  # A close goes ahead, sent or not: its session was disowned when the close was taken, so no owner's
  # exit would close it any more (it stayed open, counting against max_sessions).
  defp abandon(state, id, %{op: "close_session"}), do: unread(state, id, "close_session")

  defp abandon(state, id, entry) do
    case unqueue(state, id) do
      {:sent, state} when entry.op == "generate" ->
        cancel_on_server(state, id)

      {:sent, state} when entry.op in @making_sessions or entry.op == "unload_model" ->
        unread(state, id, entry.op)

      {_, state} ->
        state
    end
  end

  defp close_unclaimed(state, op, {:ok, %{"session" => name}}) when op in @making_sessions,
    do: send_unread(state, "close_session", %{"session" => name})

  defp close_unclaimed(state, _op, _result), do: state

  # The sessions made and relayed, until their callers claim them (`:claimed`, or `:withdraw` having
  # found the reply): a caller that gives up first (its alias dropped the reply), or dies first (the
  # reply in its mailbox), is the caller of a session nobody knows, which is closed. Its monitor stays.
  defp remember_made(state, ref, monitor, op, {:ok, %{"session" => name}}) when op in @making_sessions,
    do: %{state | made: Map.put(state.made, ref, {monitor, name})}

  defp remember_made(state, _ref, monitor, _op, _result) do
    Process.demonitor(monitor, [:flush])
    state
  end

  # Forgets the session made for `ref`'s caller; closes it if `close?`.
  defp unclaimed(state, ref, close?) do
    case Map.pop(state.made, ref) do
      {nil, _} ->
        state

      {{monitor, name}, made} ->
        Process.demonitor(monitor, [:flush])
        state = %{state | made: made}
        if close?, do: send_unread(disown(state, name), "close_session", %{"session" => name}), else: state
    end
  end

  # A session made for a caller that got its reply: closed when its owner exits, if it has one. A
  # session of the same name owned before (closed by the sidecar since, its name taken again) is not.
  defp own(state, session_owner, op, {:ok, %{"session" => name}}) when op in @making_sessions do
    state = disown(state, name)

    case session_owner do
      {:owner, pid} -> %{state | owned: Map.put(state.owned, Process.monitor(pid), name)}
      _ -> state
    end
  end

  # The sessions an unload closed are nobody's any more (whoever asked for it, and whether or not it waits).
  defp own(state, _session_owner, "unload_model", {:ok, %{"closed_sessions" => names}}) when is_list(names),
    do: Enum.reduce(names, state, &disown(&2, &1))

  defp own(state, _session_owner, _op, _result), do: state

  defp disown(state, name) do
    {gone, kept} = Enum.split_with(state.owned, fn {_monitor, owned} -> owned == name end)
    Enum.each(gone, fn {monitor, _} -> Process.demonitor(monitor, [:flush]) end)
    %{state | owned: Map.new(kept)}
  end

  defp cancel_on_server(state, target) do
    case unqueue(state, target) do
      {:unsent, state} ->
        cancelled = %{
          "text" => "",
          "token_ids" => [],
          "finish_reason" => "cancelled",
          "stats" => @nothing_run
        }

        error = Error.new(:cancelled, "the generation was cancelled before it was sent", cancelled)
        deliver(state, target, {:error_value, error})

      {:sent, state} ->
        send_unread(state, "cancel", %{"target" => target})
    end
  end

  # A request of ours that nobody waits for: a placeholder entry makes its reply be dropped quietly.
  defp send_unread(state, op, params) do
    id = state.next_id
    {:ok, state} = send_message(state, Protocol.request(id, op, params))
    unread(%{state | next_id: id + 1}, id, op)
  end

  # Request `id` runs, and nobody reads its reply (`deliver` still acts on what it did).
  defp unread(state, id, op),
    do: %{state | pending: Map.put(state.pending, id, %{ref: nil, monitor: nil, op: op})}

  defp forget_pending(state, id) do
    case Map.pop(state.pending, id) do
      {%{monitor: monitor}, pending} when monitor != nil ->
        Process.demonitor(monitor, [:flush])
        %{state | pending: pending}

      {_, pending} ->
        %{state | pending: pending}
    end
  end

  # ---- incoming ---------------------------------------------------------------------------------

  @impl true
  def handle_info({port, {:data, payload}}, %{port: port} = state) do
    case decode(state, payload) do
      {:event, id, event} ->
        with %{ref: ref} when ref != nil <- state.pending[id], do: send(ref, {Sidecar, ref, {:event, event}})
        {:noreply, state}

      {:reply, id, result} ->
        {:noreply, deliver(state, id, result)}

      {:unattributed, error} ->
        %Error{reason: reason, message: message} = Error.from_reply(error)
        Logger.warning("Sidecar: the sidecar could not attribute a message: #{reason}: #{message}")

        {:noreply, state}

      {:invalid, what} ->
        Logger.error("Sidecar: unreadable message from the sidecar: #{inspect(what, limit: 20)}")
        {:noreply, state}
    end
  end

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    sidecar_gone(state, "the sidecar exited with status #{status}", status)
  end

  # A Port that fails (a write error) may send no exit status: its link's exit says it is gone.
  def handle_info({:EXIT, port, reason}, %{port: port} = state) do
    sidecar_gone(state, "the sidecar's port closed (#{inspect(reason)})", nil)
  end

  def handle_info({cat, {:data, line}}, %{relay: %{port: cat}} = state) do
    log_line(line)
    {:noreply, state}
  end

  # Without a reader, the sidecar's stderr writes would block once the FIFO is full; with our end
  # closed they fail instead.
  def handle_info({cat, {:exit_status, _}}, %{relay: %{port: cat, writer: writer}} = state) do
    File.close(writer)
    {:noreply, %{state | relay: nil}}
  end

  def handle_info({:DOWN, monitor, :process, _pid, _reason}, state) do
    case Map.pop(state.owned, monitor) do
      {nil, _} ->
        # A caller died: forget its requests and cancel its generations, which nobody will read; close
        # the sessions made for it that it had not claimed.
        {gone, kept} = Enum.split_with(state.pending, fn {_id, entry} -> entry.monitor == monitor end)
        state = %{state | pending: Map.new(kept)}
        state = Enum.reduce(gone, state, fn {id, entry}, acc -> abandon(acc, id, entry) end)
        made = for {ref, {^monitor, _}} <- state.made, do: ref

        {:noreply, Enum.reduce(made, state, fn ref, acc -> unclaimed(acc, ref, true) end)}

      {name, owned} ->
        # A session's owner exited: the session is closed, after the requests sent on it before.
        {:noreply, send_unread(%{state | owned: owned}, "close_session", %{"session" => name})}
    end
  end

  def handle_info({:EXIT, _port, _reason}, state), do: {:noreply, state}

  def handle_info(:flush_outbox, state), do: {:noreply, flush_outbox(%{state | retrying: false})}

  # A message that is none of ours (a stray `send` to a named connection): logged and dropped, as
  # GenServer's default does, instead of crashing the connection, and its sidecar's sessions with it.
  def handle_info(message, state) do
    Logger.warning("Sidecar: the connection ignored an unexpected message: #{inspect(message, limit: 10)}")
    {:noreply, state}
  end

  defp sidecar_gone(state, message, status) do
    error = Error.new(:sidecar_exited, message, %{status: status})

    for {_id, %{ref: ref}} <- state.pending, ref != nil do
      send(ref, {Sidecar, ref, {:reply, {:error, error}}})
    end

    close_relay(state.relay)
    {:stop, {:shutdown, {:sidecar_exited, status}}, %{state | pending: %{}, port: nil, relay: nil}}
  end

  defp deliver(state, id, result) do
    case Map.pop(state.pending, id) do
      {nil, _} ->
        state

      {%{ref: nil, op: op}, pending} ->
        close_unclaimed(%{state | pending: pending}, op, result) |> own(nil, op, result)

      {%{ref: ref, monitor: monitor, op: op, owner: session_owner}, pending} ->
        # A caller that died while its reply waited in our mailbox: its :DOWN, behind the reply, closes
        # a session made for it, as for a caller that died before (`remember_made`).
        send(ref, {Sidecar, ref, {:reply, reply_value(result)}})
        state = remember_made(%{state | pending: pending}, ref, monitor, op, result)
        own(state, session_owner, op, result)
    end
  end

  defp reply_value({:ok, result}), do: {:ok, result}
  defp reply_value({:error_value, %Error{} = error}), do: {:error, error}
  defp reply_value({:error, error}), do: {:error, Error.from_reply(error)}

  @impl true
  def terminate(_reason, state) do
    if state.port, do: close_port(state.port)
    close_relay(state.relay)
  end

  # ---- codec ------------------------------------------------------------------------------------

  @doc false
  # The msgpack of a request's parameters, encoded by its caller with the connection's codec.
  # A codec of the application's that raises is a bad request, not a crash of the caller.
  # Nesting deeper than the sidecar's max_depth is refused here: past about a thousand levels its
  # msgpack reader fails before it can read the request's id, and the caller would wait in vain.
  def encode_params(%{codec: codec, max_depth: max_depth}, params) do
    cond do
      max_depth != nil and nests_deeper?(params, 1, max_depth) ->
        # as the sidecar's error: the first parameter nested too deep, and its deepest level
        {param, deepest} =
          params
          |> Enum.sort_by(fn {key, _} -> to_string(key) end)
          |> Enum.map(fn {key, value} -> {to_string(key), deepest(value, 2)} end)
          |> Enum.find(fn {_, deepest} -> deepest > max_depth end)

        {:error,
         Error.new(
           :limit_exceeded,
           "the request nests maps and lists #{deepest} deep, deeper than max_depth = #{max_depth}",
           %{"limit" => "max_depth", "max" => max_depth, "value" => deepest, "param" => param}
         )}

      true ->
        with {:ok, payload} <- encoded(codec, params), do: {:ok, IO.iodata_to_binary(payload)}
    end
  rescue
    error -> {:error, Error.new(:invalid_argument, "cannot encode the request: #{Exception.message(error)}")}
  catch
    kind, reason ->
      {:error, Error.new(:invalid_argument, "cannot encode the request: #{kind} #{inspect(reason)}")}
  end

  defp nests_deeper?(map, level, max) when is_map(map) and not is_struct(map),
    do: level > max or Enum.any?(map, fn {_, v} -> nests_deeper?(v, level + 1, max) end)

  defp nests_deeper?(list, level, max) when is_list(list),
    do: level > max or cells_nest_deeper?(list, level + 1, max)

  defp nests_deeper?(_, _, _), do: false

  # The deepest level of a map or list in `term`, itself at `level` (0 when it holds none); walked only
  # once `nests_deeper?` found it too deep.
  defp deepest(map, level) when is_map(map) and not is_struct(map),
    do: Enum.reduce(map, level, fn {_, v}, acc -> max(acc, deepest(v, level + 1)) end)

  defp deepest(list, level) when is_list(list), do: cells_deepest(list, level + 1, level)
  defp deepest(_, _), do: 0

  defp cells_deepest([head | tail], level, acc),
    do: cells_deepest(tail, level, max(acc, deepest(head, level)))

  defp cells_deepest(_, _, acc), do: acc

  # An improper tail is left to the encoder, which refuses it naming where it is.
  defp cells_nest_deeper?([head | tail], level, max),
    do: nests_deeper?(head, level, max) or cells_nest_deeper?(tail, level, max)

  defp cells_nest_deeper?(_, _, _), do: false

  # A frame of ours (hello, cancel): a small map of ints and strings, which the built-in codec always
  # encodes (an application's codec failing here would take the connection down with it).
  defp send_message(state, message) do
    {:ok, payload} = Sidecar.Msgpack.encode(message)
    queue_frame(state, message["id"], payload, :uncapped)
  end

  # A caller's request: its parameters come encoded, the id and op go in front.
  defp queue_request(state, id, op, body) do
    case Sidecar.Msgpack.prepend_entries(body, [{"id", id}, {"op", op}]) do
      {:ok, payload} -> queue_frame(state, id, payload, :capped)
      :error -> {:error, Error.new(:invalid_argument, "the codec did not encode the parameters as a map")}
    end
  end

  defp queue_frame(state, id, payload, capped) do
    size = IO.iodata_length(payload)

    with :ok <- within_frame_limit(state.hello, size),
         :ok <- within_outbox_limit(state, size, capped) do
      queued = %{
        state
        | outbox: :queue.in({id, payload, size}, state.outbox),
          outbox_bytes: state.outbox_bytes + size
      }

      {:ok, flush_outbox(queued)}
    end
  end

  # Requests waiting unsent (the sidecar not reading) hold at most what the sidecar itself would queue.
  defp within_outbox_limit(%{hello: %{"limits" => %{"max_queued_bytes" => max}}} = state, size, :capped)
       when state.outbox_bytes + size > max do
    {:error,
     Error.new(
       :too_many_requests,
       "the sidecar is not reading: #{state.outbox_bytes} bytes of requests wait unsent, and this one would " <>
         "pass max_queued_bytes = #{max}",
       %{"limit" => "max_queued_bytes", "max" => max, "value" => state.outbox_bytes + size}
     )}
  end

  defp within_outbox_limit(_state, _size, _capped), do: :ok

  # Hands the Port what it takes without suspending us; the rest is tried again in @retry_ms. A port
  # already closed (its exit status not yet read) takes nothing: its exit answers every request.
  defp flush_outbox(%{port: nil} = state), do: state

  defp flush_outbox(state) do
    case :queue.peek(state.outbox) do
      :empty ->
        state

      {:value, {_id, payload, size}} ->
        case port_command(state.port, payload) do
          true ->
            flush_outbox(%{state | outbox: :queue.drop(state.outbox), outbox_bytes: state.outbox_bytes - size})

          false ->
            unless state.retrying, do: Process.send_after(self(), :flush_outbox, @retry_ms)
            %{state | retrying: true}

          :closed ->
            state
        end
    end
  end

  defp port_command(port, payload) do
    Port.command(port, payload, [:nosuspend])
  rescue
    ArgumentError -> :closed
  end

  # Takes request `id` out of the outbox: {:unsent, state} if it was there, {:sent, state} otherwise.
  defp unqueue(state, id) do
    case Enum.split_with(:queue.to_list(state.outbox), fn {queued, _, _} -> queued == id end) do
      {[], _} ->
        {:sent, state}

      {[{_, _, size}], kept} ->
        {:unsent, %{state | outbox: :queue.from_list(kept), outbox_bytes: state.outbox_bytes - size}}
    end
  end

  defp encoded(codec, message) do
    case codec.encode(message) do
      {:ok, payload} ->
        {:ok, payload}

      {:error, {:unsupported, value, why, path}} ->
        where = Enum.map_join(path, ".", &to_string/1)

        {:error,
         Error.new(
           :invalid_argument,
           "cannot send #{where}: #{why}, got #{inspect(value, limit: 5, printable_limit: 40)}",
           %{"param" => List.first(path)}
         )}

      {:error, reason} ->
        {:error, Error.new(:invalid_argument, "cannot encode the request: #{inspect(reason)}")}
    end
  end

  # A frame over the sidecar's max_frame_bytes would be discarded unread, and answered with no id when
  # a large value comes before "id" (keys go sorted): it is refused here, unsent. (No limit before hello.)
  defp within_frame_limit(%{"limits" => %{"max_frame_bytes" => max}}, size) when size > max do
    {:error,
     Error.new(
       :frame_too_large,
       "the request is #{size} bytes, over the sidecar's max_frame_bytes = #{max}; it was not sent",
       %{"limit" => "max_frame_bytes", "max" => max, "value" => size}
     )}
  end

  defp within_frame_limit(_hello, _size), do: :ok

  defp decode(state, payload) do
    case state.codec.decode(payload) do
      {:ok, message} -> Protocol.classify(message)
      other -> {:invalid, {:undecodable, other}}
    end
  rescue
    error -> {:invalid, {:undecodable, error}}
  catch
    kind, reason -> {:invalid, {:undecodable, {kind, reason}}}
  end

  # Logs a relayed line and returns it.
  defp log_line({_eol_or_noeol, line}) do
    level =
      cond do
        line =~ ~r/\b(ERROR|CRITICAL)\b/ -> :error
        line =~ ~r/\bWARNING\b/ -> :warning
        line =~ ~r/\bDEBUG\b/ -> :debug
        line =~ ~r/\bINFO\b/ -> :info
        # not a line of the sidecar's logger: a traceback, a native library's abort, a Python warning
        true -> :warning
      end

    Logger.log(level, "[sidecar] " <> line)
    line
  end
end
