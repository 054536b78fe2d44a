defmodule Sidecar.SupervisionTest do
  use ExUnit.Case, async: false

  import Sidecar.Test.Helpers
  alias Sidecar.Error

  @moduletag timeout: 180_000

  test "a crashed sidecar fails in-flight calls, restarts under its supervisor, and loses its sessions" do
    {:ok, supervisor} =
      Supervisor.start_link([{Sidecar, sidecar_opts(name: :crashing_sidecar)}], strategy: :one_for_one)

    old = Process.whereis(:crashing_sidecar)
    {:ok, %{"os_pid" => old_os_pid}} = Sidecar.info(:crashing_sidecar)
    {:ok, session} = Sidecar.open_session(:crashing_sidecar)

    task =
      Task.async(fn ->
        failed = Sidecar.generate(:crashing_sidecar, session, [5, 6], max_new_tokens: 1_900, eos_token_id: [])
        # at once, as a caller retries: the connection that failed it has not stopped yet (found from
        # outside: it drains the sidecar's stderr first, and the call got :not_running at once)
        {failed, Sidecar.open_session(:crashing_sidecar, timeout: 60_000), Sidecar.info(:crashing_sidecar)}
      end)

    assert eventually(fn -> match?({:ok, %{"active_generations" => 1}}, Sidecar.stats(:crashing_sidecar)) end)

    System.cmd("kill", ["-9", Integer.to_string(old_os_pid)])

    assert {{:error, %Error{reason: :sidecar_exited}}, {:ok, %Sidecar.Session{}},
            {:ok, %{"os_pid" => os_pid}}} = Task.await(task, 60_000)

    assert os_pid != old_os_pid

    # While its supervisor restarts it, info and ping answer, if only with an error.
    assert eventually(
             fn ->
               ping = Sidecar.ping(:crashing_sidecar)
               assert ping == :ok or match?({:error, %Error{}}, ping)

               case Sidecar.info(:crashing_sidecar) do
                 {:ok, %{"os_pid" => os_pid}} -> os_pid != old_os_pid
                 {:error, %Error{reason: :not_running}} -> false
               end
             end,
             60_000
           )

    assert Process.whereis(:crashing_sidecar) != old

    assert {:error, %Error{reason: :session_lost}} =
             Sidecar.generate(:crashing_sidecar, session, [5, 6], max_new_tokens: 2)

    {:ok, fresh} = Sidecar.open_session(:crashing_sidecar)

    assert {:ok, %{token_ids: [_, _]}} =
             Sidecar.generate(:crashing_sidecar, fresh, [5, 6], max_new_tokens: 2, eos_token_id: [])

    Supervisor.stop(supervisor)
  end

  test "a call waits for a restart under way within its own timeout, not longer" do
    marker = Path.join(System.tmp_dir!(), "slow-restart-#{System.unique_integer([:positive])}")
    wrapper = marker <> ".sh"

    # a sidecar whose restart takes 3 s (a large model loading, say): the wrapper sleeps once the marker exists
    File.write!(
      wrapper,
      ~s(#!/bin/sh\nif [ -e "#{marker}" ]; then sleep 3; fi\nexec "#{sidecar_opts()[:python]}" "$@"\n)
    )

    File.chmod!(wrapper, 0o700)

    on_exit(fn ->
      File.rm(wrapper)
      File.rm(marker)
    end)

    {:ok, supervisor} =
      Supervisor.start_link([{Sidecar, sidecar_opts(name: :slow_restart, python: wrapper)}],
        strategy: :one_for_one
      )

    old = Process.whereis(:slow_restart)
    {:ok, %{"os_pid" => os_pid}} = Sidecar.info(:slow_restart)
    File.write!(marker, "")
    System.cmd("kill", ["-9", Integer.to_string(os_pid)])
    assert eventually(fn -> Process.whereis(:slow_restart) not in [nil, old] end)

    started = System.monotonic_time(:millisecond)
    assert {:error, %Error{reason: :timeout}} = Sidecar.ping(:slow_restart, 300)
    assert {:error, %Error{reason: :timeout}} = Sidecar.generate(:slow_restart, "s", [5], timeout: 300)
    assert {:error, %Error{reason: :timeout}} = Sidecar.open_session(:slow_restart, timeout: 300)
    # each gave up after its own 300 ms, not once the 3 s restart was over
    assert System.monotonic_time(:millisecond) - started < 2_500
    assert eventually(fn -> Sidecar.ping(:slow_restart) == :ok end, 30_000)
    Supervisor.stop(supervisor)
  end

  test "await after the connection went down returns the replies it sent before, and leaves none behind" do
    Process.flag(:trap_exit, true)
    {:ok, conn} = Sidecar.start_link(sidecar_opts())
    {:ok, %{"os_pid" => os_pid}} = Sidecar.info(conn)
    {:ok, session} = Sidecar.open_session(conn)
    {:ok, other} = Sidecar.open_session(conn)
    {:ok, done} = Sidecar.start_generate(conn, session, [5, 6], max_new_tokens: 3, eos_token_id: [])

    {:ok, running} = Sidecar.start_generate(conn, other, [5, 6], max_new_tokens: 1_900, eos_token_id: [])

    # the first one's reply is in this mailbox, the second one still generating
    assert eventually(fn -> match?({:ok, %{"active_generations" => 1}}, Sidecar.stats(conn)) end)
    System.cmd("kill", ["-9", Integer.to_string(os_pid)])
    assert_receive {:EXIT, ^conn, {:shutdown, {:sidecar_exited, 137}}}, 10_000

    assert {:error, %Error{reason: :sidecar_exited, details: %{status: 137}}} = Sidecar.await(running)
    assert {:ok, %{token_ids: [_, _, _]}} = Sidecar.await(done)
    {:messages, left} = Process.info(self(), :messages)
    # (System.cmd's port, linked to this process, leaves its :EXIT)
    assert [] == Enum.filter(left, &(match?({Sidecar, _, _}, &1) or match?({:DOWN, _, _, _, _}, &1)))
  end

  test "when the owning process dies, the Python process exits" do
    test_pid = self()

    owner =
      spawn(fn ->
        {:ok, conn} = Sidecar.start_link(sidecar_opts(model: nil))
        {:ok, %{"os_pid" => os_pid}} = Sidecar.info(conn)
        send(test_pid, {:started, conn, os_pid})
        Process.sleep(:infinity)
      end)

    assert_receive {:started, conn, os_pid}, 120_000
    assert os_alive?(os_pid)
    Process.exit(conn, :kill)
    assert eventually(fn -> not os_alive?(os_pid) end, 2_000), "the Python process outlived its owner by 2 s"
    Process.exit(owner, :kill)
  end

  test "a connection killed mid-run leaves its stderr relay nothing to complain about on the BEAM's stderr" do
    # In a BEAM of its own, whose stderr we read: the sidecar's last log lines reach the relay after
    # the relay's port is gone.
    script = """
    Process.flag(:trap_exit, true)
    {:ok, conn} = Sidecar.start_link(Sidecar.Test.Helpers.sidecar_opts(model: nil))
    Process.exit(conn, :kill)
    Process.sleep(1_000)
    """

    {out, status} =
      System.cmd(System.find_executable("elixir"), ["-pa", Mix.Project.compile_path(), "-e", script],
        stderr_to_stdout: true
      )

    assert status == 0, out
    refute out =~ "Broken pipe"
  end

  test "a connection killed while its sidecar starts leaves no FIFO behind" do
    fifos = fn -> Path.wildcard(Path.join(System.tmp_dir!(), "sidecar-stderr-*-#{:os.getpid()}")) end
    before = fifos.()
    marker = Path.join(System.tmp_dir!(), "starting-#{System.unique_integer([:positive])}")
    wrapper = marker <> ".sh"
    # a sidecar that takes its time to start (a large model loading), once its stderr is the FIFO
    File.write!(wrapper, ~s(#!/bin/sh\ntouch "#{marker}"\nsleep 2\nexec "#{sidecar_opts()[:python]}" "$@"\n))
    File.chmod!(wrapper, 0o700)

    on_exit(fn ->
      File.rm(wrapper)
      File.rm(marker)
    end)

    Task.start(fn -> Sidecar.start_link(sidecar_opts(name: :killed_starting, python: wrapper)) end)
    assert eventually(fn -> File.exists?(marker) end)
    Process.exit(Process.whereis(:killed_starting), :kill)
    # the FIFO went once the sidecar's stderr was open (it stayed in the temporary directory until hello)
    assert fifos.() -- before == []
  end

  test "a connection killed at any moment of its start leaves no process waiting on its FIFO, nor the FIFO" do
    # found from outside: killed within milliseconds of starting, `cat` or the sidecar's shell could be left
    # waiting in open() on the FIFO for ever (the shell holding the BEAM's stdout), and the FIFO on disk
    mine = "sidecar-stderr-"
    tag = "-#{:os.getpid()}"
    fifos = fn -> Path.wildcard(Path.join(System.tmp_dir!(), "#{mine}*#{tag}")) end

    # processes naming one of our FIFOs in their arguments (waiting to open it) or holding it open
    holders = fn ->
      for dir <- Path.wildcard("/proc/[0-9]*"),
          {:ok, cmdline} <- [File.read(Path.join(dir, "cmdline"))],
          links = for(fd <- Path.wildcard(Path.join(dir, "fd/*")), {:ok, l} <- [File.read_link(fd)], do: l),
          Enum.any?([cmdline | links], &(&1 =~ mine and &1 =~ tag)),
          do: dir
    end

    # a sidecar that only sleeps: what is tested is what runs before it
    sleeper = Path.join(System.tmp_dir!(), "sleeper-#{System.unique_integer([:positive])}.sh")
    File.write!(sleeper, "#!/bin/sh\nexec sleep 2\n")
    File.chmod!(sleeper, 0o700)
    on_exit(fn -> File.rm(sleeper) end)
    {before_fifos, before_holders} = {fifos.(), holders.()}

    for delay <- [0, 1, 2, 3, 5, 8, 12] do
      Task.start(fn -> Sidecar.start_link(sidecar_opts(name: :killed_early, python: sleeper)) end)
      pid = Stream.repeatedly(fn -> Process.whereis(:killed_early) end) |> Enum.find(& &1)
      Process.sleep(delay)
      Process.exit(pid, :kill)
      assert eventually(fn -> Process.whereis(:killed_early) == nil end)
    end

    assert eventually(
             fn -> fifos.() -- before_fifos == [] and holders.() -- before_holders == [] end,
             10_000
           ),
           "left behind: #{inspect(fifos.() -- before_fifos)}, processes #{inspect(holders.() -- before_holders)}"
  end

  test "info and ping on a connection that is not there are errors, not exits" do
    assert {:error, %Error{reason: :not_running}} = Sidecar.info(:no_such_sidecar)
    assert {:error, %Error{reason: :not_running}} = Sidecar.ping(:no_such_sidecar)
    {dead, monitor} = spawn_monitor(fn -> :ok end)
    assert_receive {:DOWN, ^monitor, :process, ^dead, _}
    assert {:error, %Error{reason: :not_running}} = Sidecar.info(dead)
    assert {:error, %Error{reason: :not_running}} = Sidecar.ping(dead)
    # a pid of another node (one this node cannot reach): Process.alive?/1 raised on it
    remote = :erlang.binary_to_term(<<131, 88, 100, 14::16, "nobody@nowhere", 0::32, 0::32, 1::32>>)
    assert node(remote) == :nobody@nowhere
    assert {:error, %Error{reason: :not_running}} = Sidecar.info(remote)
    assert {:error, %Error{reason: :not_running}} = Sidecar.ping(remote)
    assert {:error, %Error{reason: :not_running}} = Sidecar.generate(remote, "s", "Hi")
    # (helper-89) a session of a connection no longer running: not running, as any call there, where
    # :session_lost had a LiveView open a session anew, which failed
    gone = %Sidecar.Session{name: "s", model: "default", eos_token_ids: nil, incarnation: make_ref()}

    assert {:error, %Error{reason: :not_running}} =
             Sidecar.generate(:no_such_sidecar, gone, "Hi", timeout: 200)
  end

  test "a call to a name that a restart leaves unregistered for some milliseconds waits for it" do
    {:ok, conn} = Sidecar.start_link(sidecar_opts())
    {:ok, session} = Sidecar.open_session(conn)

    # as a supervisor's restart does: the name is registered a moment after the calls look it up
    calls = [
      Task.async(fn -> Sidecar.ping(:registered_late) end),
      Task.async(fn -> Sidecar.info(:registered_late) end),
      Task.async(fn -> Sidecar.generate(:registered_late, session.name, [5, 6], max_new_tokens: 2) end)
    ]

    # (10 ms: well within the 100 ms a name is looked up for, on a busy machine too)
    Process.sleep(10)
    Process.register(conn, :registered_late)
    assert [:ok, {:ok, %{"os_pid" => _}}, {:ok, %{token_ids: [_, _]}}] = Task.await_many(calls, 10_000)
    Process.unregister(:registered_late)
    GenServer.stop(conn)
  end

  test "a value that is no connection is an ArgumentError that says what a connection is" do
    for call <- [&Sidecar.ping/1, &Sidecar.info/1, &Sidecar.open_session/1],
        bad <- [123, {1, 2}, {:a, :b, :c}, "name"] do
      assert_raise ArgumentError, ~r/not a connection: .* \(a pid, or a name/, fn -> call.(bad) end
    end
  end

  describe "a sidecar that cannot start is an error from start_link and leaves no process behind" do
    setup do
      Process.flag(:trap_exit, true)
      %{before: ours()}
    end

    test "a missing model: the message is the sidecar's own", %{before: before} do
      assert {:error,
              %Error{reason: :sidecar_exited, message: message, details: %{status: 2, stderr: stderr}}} =
               Sidecar.start_link(sidecar_opts(model: "/nonexistent/model"))

      assert message =~ ~r/^the sidecar exited with status 2 during startup: .*\/nonexistent\/model/
      assert message =~ "model_not_found" or message =~ "config.json"
      assert stderr =~ "/nonexistent/model"
      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end

    test "a bad flag: argparse's error, printed before the sidecar's own setup", %{before: before} do
      assert {:error,
              %Error{reason: :sidecar_exited, message: message, details: %{status: 2, stderr: stderr}}} =
               Sidecar.start_link(sidecar_opts(args: ["--no-such-flag"]))

      assert message =~ ~r/status 2 during startup: .*error: unrecognized arguments: --no-such-flag/
      # the whole tail, usage text included
      assert stderr =~ "usage:" and stderr =~ "--no-such-flag"
      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end

    test "an argument that prints and exits, such as --version: the message says it did not serve",
         %{before: before} do
      assert {:error, %Error{reason: :sidecar_exited, message: message, details: %{status: 0}}} =
               Sidecar.start_link(sidecar_opts(args: ["--version"]))

      assert message =~ ~r/^the sidecar exited with status 0 during startup: it ended without serving/
      assert message =~ "--version"
      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end

    test "a device this machine lacks: the sidecar's message names it and what there is", %{before: before} do
      assert {:error,
              %Error{reason: :sidecar_exited, message: message, details: %{status: 2, stderr: stderr}}} =
               Sidecar.start_link(sidecar_opts(model: nil, device: "cuda:7"))

      assert message =~ ~r/^the sidecar exited with status 2 during startup: --device: .*cuda:7.*: cpu/
      assert stderr =~ "cuda:7"
      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end

    test "a Python without the sidecar package: the message says how to point :python at the venv",
         %{before: before} do
      python = python_without_sidecar()

      assert {:error, %Error{reason: :sidecar_exited, message: message, details: %{stderr: stderr}}} =
               Sidecar.start_link(sidecar_opts(python: python, cd: System.tmp_dir!()))

      assert message =~ "#{python} has no sidecar package (No module named sidecar)"
      assert message =~ ~s(set the :python option) and message =~ ".venv/bin/python"
      assert stderr =~ "No module named sidecar"
      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end

    test "its stderr: the logger's lines at their level, any other line (an abort, a traceback) a warning" do
      script = Path.join(System.tmp_dir!(), "noisy-#{System.unique_integer([:positive])}")

      File.write!(script, """
      #!/bin/sh
      echo "2026-11-29 12:00:00,000 INFO sidecar: starting" >&2
      echo "memory allocation of 1224736724 bytes failed" >&2
      exit 3
      """)

      File.chmod!(script, 0o755)

      log =
        ExUnit.CaptureLog.capture_log(fn ->
          assert {:error, %Error{reason: :sidecar_exited}} = Sidecar.start_link(sidecar_opts(python: script))
        end)

      File.rm!(script)
      assert log =~ ~r/\[info\][^\n]*\[sidecar\] [^\n]*INFO sidecar: starting/
      assert log =~ ~r/\[warning\][^\n]*\[sidecar\] memory allocation of 1224736724 bytes failed/
    end

    test "a wrong executable that exits at once", %{before: before} do
      assert {:error,
              %Error{reason: :sidecar_exited, message: "the sidecar exited with status 1 during startup"}} =
               Sidecar.start_link(sidecar_opts(python: System.find_executable("false")))

      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end

    test "start/1 returns the error without a link: a caller that does not trap exits lives on", %{
      before: before
    } do
      parent = self()

      caller =
        spawn(fn ->
          Process.flag(:trap_exit, false)
          send(parent, {:started, Sidecar.start(sidecar_opts(python: System.find_executable("false")))})
          Process.sleep(:infinity)
        end)

      assert_receive {:started, {:error, %Error{reason: :sidecar_exited}}}, 10_000
      # start_link/1 would have sent the failure as an exit signal, which ends such a caller
      Process.sleep(100)
      assert Process.alive?(caller)
      Process.exit(caller, :kill)
      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end

    test "no hello within startup_timeout", %{before: before} do
      assert {:error, %Error{reason: :timeout}} = Sidecar.start_link(sidecar_opts(startup_timeout: 200))
      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end
  end

  # /usr/bin/python3 when it lacks the package (it does on Debian), or else the venv's Python
  # isolated from its site-packages (-I -S) by a wrapper script.
  defp python_without_sidecar do
    system = "/usr/bin/python3"

    if File.exists?(system) and
         match?(
           {_, status} when status != 0,
           System.cmd(system, ["-c", "import sidecar"], cd: System.tmp_dir!(), stderr_to_stdout: true)
         ) do
      system
    else
      wrapper = Path.join(System.tmp_dir!(), "python-without-sidecar-#{System.unique_integer([:positive])}")
      File.write!(wrapper, ~s(#!/bin/sh\nexec "#{sidecar_opts()[:python]}" -I -S "$@"\n))
      File.chmod!(wrapper, 0o700)
      on_exit(fn -> File.rm(wrapper) end)
      wrapper
    end
  end

  # OS pids of the processes this BEAM spawned that still run (stderr relays, sidecars): the
  # children of its erl_child_setup. pgrep never lists itself.
  defp ours do
    {setup, 0} = System.cmd("pgrep", ["-P", "#{:os.getpid()}", "erl_child_setup"])
    {out, _} = System.cmd("pgrep", ["-P", String.trim(setup)])
    String.split(out)
  end
end
