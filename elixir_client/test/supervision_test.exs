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
        Sidecar.generate(:crashing_sidecar, session, [5, 6], max_new_tokens: 1_900, eos_token_id: [])
      end)

    assert eventually(fn -> match?({:ok, %{"active_generations" => 1}}, Sidecar.stats(:crashing_sidecar)) end)

    System.cmd("kill", ["-9", Integer.to_string(old_os_pid)])
    assert {:error, %Error{reason: :sidecar_exited}} = Task.await(task, 10_000)

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

  test "info and ping on a connection that is not there are errors, not exits" do
    assert {:error, %Error{reason: :not_running}} = Sidecar.info(:no_such_sidecar)
    assert {:error, %Error{reason: :not_running}} = Sidecar.ping(:no_such_sidecar)
    {dead, monitor} = spawn_monitor(fn -> :ok end)
    assert_receive {:DOWN, ^monitor, :process, ^dead, _}
    assert {:error, %Error{reason: :not_running}} = Sidecar.info(dead)
    assert {:error, %Error{reason: :not_running}} = Sidecar.ping(dead)
  end

  describe "a sidecar that cannot start is an error from start_link and leaves no process behind" do
    setup do
      Process.flag(:trap_exit, true)
      %{before: ours()}
    end

    test "a missing model", %{before: before} do
      assert {:error, %Error{reason: :sidecar_exited, details: %{status: 2}}} =
               Sidecar.start_link(sidecar_opts(model: "/nonexistent/model"))

      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end

    test "a bad flag, before the sidecar opens its stderr FIFO", %{before: before} do
      assert {:error, %Error{reason: :sidecar_exited, details: %{status: 2}}} =
               Sidecar.start_link(sidecar_opts(args: ["--no-such-flag"]))

      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end

    test "a wrong executable that exits at once", %{before: before} do
      assert {:error, %Error{reason: :sidecar_exited}} =
               Sidecar.start_link(sidecar_opts(python: System.find_executable("false")))

      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end

    test "no hello within startup_timeout", %{before: before} do
      assert {:error, %Error{reason: :timeout}} = Sidecar.start_link(sidecar_opts(startup_timeout: 200))
      assert eventually(fn -> ours() -- before == [] end, 1_000)
    end
  end

  # OS pids of this BEAM's stderr relays and sidecars: both name the relay's FIFO, which names the BEAM.
  defp ours do
    {out, _} = System.cmd("pgrep", ["-f", "sidecar-stderr-[0-9]+-#{:os.getpid()}"])
    String.split(out)
  end
end
