defmodule Sidecar.PersistTest do
  # Forked, saved and restored sessions, against real sidecars sharing a temporary session directory.
  use ExUnit.Case, async: false

  import Sidecar.Test.Helpers
  alias Sidecar.{Error, Session}

  @moduletag timeout: 180_000
  @opts [max_new_tokens: 3, eos_token_id: []]

  setup_all do
    dir = Path.join(System.tmp_dir!(), "sidecar-sessions-#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir, conn: start_supervised!({Sidecar, sidecar_opts(session_dir: dir)})}
  end

  test "a fork and a save sent behind a generation see the session as it leaves it", %{conn: conn, dir: dir} do
    {:ok, session} = Sidecar.open_session(conn)
    {:ok, request} = Sidecar.start_generate(conn, session, [5, 6, 7, 8], @opts)

    assert {:ok, %Session{name: "fork-a"} = fork} = Sidecar.fork_session(conn, session, name: "fork-a")

    assert {:ok, %{"name" => "saved-a", "history_tokens" => 7, "cached_tokens" => 6, "bytes" => bytes}} =
             Sidecar.save_session(conn, session, "saved-a")

    assert File.stat!(Path.join(dir, "saved-a.safetensors")).size == bytes
    assert {:ok, %{token_ids: generated}} = Sidecar.await(request)

    assert {:ok, %{"history_tokens" => 7, "cached_tokens" => cached}} = Sidecar.session_info(conn, fork)
    continued = [5, 6, 7, 8] ++ generated ++ [9]
    assert {:ok, in_fork} = Sidecar.generate(conn, fork, continued, @opts)
    assert in_fork.stats.reused_tokens == cached and cached == 6

    # independent: the fork's generation left its source as it was
    assert {:ok, %{"history_tokens" => 7}} = Sidecar.session_info(conn, session)
    assert {:ok, %{token_ids: ids}} = Sidecar.generate(conn, session, continued, @opts)
    assert ids == in_fork.token_ids

    # a fork of a name is a name, chosen by the sidecar unless given; a taken name is refused
    assert {:ok, name} = Sidecar.fork_session(conn, session.name)
    assert is_binary(name) and name not in [session.name, fork.name]

    assert {:error, %Error{reason: :session_exists, details: %{"session" => "fork-a"}}} =
             Sidecar.fork_session(conn, session, name: "fork-a")

    for s <- [session, fork, name], do: :ok = Sidecar.close_session(conn, s)
  end

  test "another sidecar on the same directory restores a session that continues as a fork does",
       %{conn: conn, dir: dir} do
    {:ok, session} = Sidecar.open_session(conn)
    {:ok, %{token_ids: generated}} = Sidecar.generate(conn, session, [5, 6, 7, 8], @opts)
    {:ok, _} = Sidecar.save_session(conn, session, "shared")
    {:ok, fork} = Sidecar.fork_session(conn, session)
    continued = [5, 6, 7, 8] ++ generated ++ [9, 10]
    {:ok, in_fork} = Sidecar.generate(conn, fork, continued, max_new_tokens: 4, eos_token_id: [])

    other = start_supervised!({Sidecar, sidecar_opts(session_dir: dir)}, id: :other_sidecar)
    {:ok, %{"incarnation" => incarnation}} = Sidecar.info(other)

    assert {:ok, %Session{model: %{"name" => "default"}, incarnation: ^incarnation} = restored} =
             Sidecar.restore_session(other, "shared", session: "restored")

    assert restored.name == "restored" and restored.eos_token_ids == session.eos_token_ids
    assert {:ok, %{"history_tokens" => 7, "cached_tokens" => 6}} = Sidecar.session_info(other, restored)

    assert {:ok, continuation} =
             Sidecar.generate(other, restored, continued, max_new_tokens: 4, eos_token_id: [])

    assert continuation.token_ids == in_fork.token_ids
    assert continuation.stats.reused_tokens == 6

    assert {:error, %Error{reason: :session_exists, details: %{"session" => "restored"}}} =
             Sidecar.restore_session(other, "shared", session: "restored")

    # a restored session with an owner goes with it
    owner = spawn(fn -> receive do: (:stop -> :ok) end)
    {:ok, owned} = Sidecar.restore_session(other, "shared", owner: owner)
    assert {:ok, _} = Sidecar.session_info(other, owned)
    Process.exit(owner, :kill)

    assert eventually(fn ->
             match?({:error, %Error{reason: :unknown_session}}, Sidecar.session_info(other, owned))
           end)

    for s <- [session, fork], do: :ok = Sidecar.close_session(conn, s)
  end

  test "no such saved session, a truncated file, a name that is a path", %{conn: conn, dir: dir} do
    assert {:error, %Error{reason: :invalid_session_file}} = Sidecar.restore_session(conn, "never-saved")

    {:ok, session} = Sidecar.open_session(conn)
    {:ok, _} = Sidecar.generate(conn, session, [5, 6, 7, 8], @opts)
    {:ok, %{"bytes" => bytes}} = Sidecar.save_session(conn, session, "truncated")
    path = Path.join(dir, "truncated.safetensors")
    File.write!(path, binary_part(File.read!(path), 0, div(bytes, 2)))
    {:ok, %{"sessions" => open}} = Sidecar.stats(conn)
    assert {:error, %Error{reason: :invalid_session_file}} = Sidecar.restore_session(conn, "truncated")
    assert {:ok, %{"sessions" => ^open}} = Sidecar.stats(conn)

    for name <- ["../x", "", ".hidden", String.duplicate("a", 129)] do
      assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "name"}}} =
               Sidecar.save_session(conn, session, name)

      assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "name"}}} =
               Sidecar.restore_session(conn, name)
    end

    refute File.exists?(Path.join(dir, "../x.safetensors"))
    :ok = Sidecar.close_session(conn, session)
  end
end
