defmodule Sidecar.SupervisionTest do
  use ExUnit.Case, async: false

  import Sidecar.Test.Helpers
  alias Sidecar.Error

  @moduletag timeout: 180_000

  test "a crashed sidecar fails in-flight calls, restarts under its supervisor, and loses its sessions" do
    {:ok, supervisor} =
      Supervisor.start_link([{Sidecar, sidecar_opts(name: :crashing_sidecar)}], strategy: :one_for_one)

    old = Process.whereis(:crashing_sidecar)
    old_os_pid = Sidecar.info(:crashing_sidecar)["os_pid"]
    {:ok, session} = Sidecar.open_session(:crashing_sidecar)

    task =
      Task.async(fn ->
        Sidecar.generate(:crashing_sidecar, session, [5, 6], max_new_tokens: 1_900, eos_token_id: [])
      end)

    assert eventually(fn -> match?({:ok, %{"active_generations" => 1}}, Sidecar.stats(:crashing_sidecar)) end)

    System.cmd("kill", ["-9", Integer.to_string(old_os_pid)])
    assert {:error, %Error{reason: :sidecar_exited}} = Task.await(task, 10_000)

    assert eventually(
             fn -> (pid = Process.whereis(:crashing_sidecar)) && pid != old && Process.alive?(pid) end,
             60_000
           )

    assert Sidecar.info(:crashing_sidecar)["os_pid"] != old_os_pid

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
        send(test_pid, {:started, conn, Sidecar.info(conn)["os_pid"]})
        Process.sleep(:infinity)
      end)

    assert_receive {:started, conn, os_pid}, 120_000
    assert os_alive?(os_pid)
    Process.exit(conn, :kill)
    assert eventually(fn -> not os_alive?(os_pid) end, 2_000), "the Python process outlived its owner by 2 s"
    Process.exit(owner, :kill)
  end

  test "a sidecar that cannot start is an error from start_link" do
    Process.flag(:trap_exit, true)

    assert {:error, %Error{reason: :sidecar_exited, details: %{status: 2}}} =
             Sidecar.start_link(sidecar_opts(model: "/nonexistent/model"))
  end
end
