defmodule SidecarTest do
  # Against the real Python sidecar with the tiny default model.
  use ExUnit.Case, async: false

  import Sidecar.Test.Helpers
  alias Sidecar.Error
  alias Sidecar.Processors.{SuppressTokens, TopK}

  @moduletag timeout: 180_000

  setup_all do
    # `cold` shares no prefixes across sessions: a fresh session there computes everything, the reference
    # models may be loaded from the temporary directory (a copy of the default model with its own generation config)
    conn =
      start_supervised!({Sidecar, sidecar_opts(device: "cpu", args: ["--model-root", System.tmp_dir!()])},
        id: :conn
      )

    cold = start_supervised!({Sidecar, sidecar_opts(share_prefixes: false)}, id: :cold)
    %{conn: conn, cold: cold}
  end

  defp tokens(seed, n), do: for(i <- 1..n, do: 7 + rem(seed * 31 + i * 17, 900))

  defp fresh_generate(conn, input, opts) do
    {:ok, session} = Sidecar.open_session(conn)
    result = Sidecar.generate(conn, session, input, opts)
    :ok = Sidecar.close_session(conn, session)
    result
  end

  test "ping and info", %{conn: conn} do
    assert :ok = Sidecar.ping(conn)
    assert {:ok, info} = Sidecar.info(conn)
    assert info["protocol_version"] == 1 and is_integer(info["os_pid"]) and info["models"] == ["default"]
  end

  test "every processor struct matches the sidecar's declaration", %{conn: conn} do
    {:ok, %{"processor_options" => declared}} = Sidecar.info(conn)
    assert Map.keys(declared) |> Enum.sort() == Sidecar.Processors.all() |> Map.keys() |> Enum.sort()

    for {name, module} <- Sidecar.Processors.all() do
      fields =
        module |> struct() |> Map.from_struct() |> Map.keys() |> Enum.map(&Atom.to_string/1) |> Enum.sort()

      assert fields == declared[name] |> Enum.map(& &1["name"]) |> Enum.sort(), name
      required = for %{"name" => n, "required" => true} <- declared[name], do: String.to_atom(n)
      assert Enum.sort(required) == Enum.sort(module.__processor__().required), name
    end
  end

  test "tokenize and detokenize", %{conn: conn} do
    assert {:ok, ids} = Sidecar.tokenize(conn, "héllo wörld")
    assert {:ok, "héllo wörld"} = Sidecar.detokenize(conn, ids)
    assert {:error, %Error{reason: :unknown_model}} = Sidecar.tokenize(conn, "x", model: "nope")
  end

  describe "the three Petals cases reuse the cache and mean the same as a fresh session" do
    setup %{cold: conn} do
      pieces = for {marker, seed} <- Enum.zip([3, 4, 5, 6], 1..4), do: [marker | tokens(seed, 19)]
      {:ok, session} = Sidecar.open_session(conn)
      on_exit(fn -> Sidecar.close_session(conn, session) end)
      %{session: session, pieces: pieces}
    end

    for name <- [:prefix, :different_suffix, :rolling] do
      test "#{name}", %{cold: conn, session: session, pieces: pieces} do
        {first, second, reuse} = petals_case(unquote(name), pieces)
        opts = [max_new_tokens: 8, eos_token_id: []]
        assert {:ok, earlier} = Sidecar.generate(conn, session, first, opts)
        assert hd(earlier.token_ids) not in [4, 5]
        assert {:ok, reused} = Sidecar.generate(conn, session, second, opts)
        assert {:ok, fresh} = fresh_generate(conn, second, opts)
        assert reused.token_ids == fresh.token_ids and reused.text == fresh.text
        assert reused.stats.reused_tokens == reuse
        assert fresh.stats.reused_tokens == 0
      end
    end
  end

  test "a session continues a prefix another session computed, with the cold result", %{
    conn: conn,
    cold: cold
  } do
    system = tokens(77, 40)
    {:ok, first} = Sidecar.open_session(conn)
    {:ok, second} = Sidecar.open_session(conn)
    opts = [max_new_tokens: 6, eos_token_id: []]
    assert {:ok, _} = Sidecar.generate(conn, first, system ++ [3 | tokens(78, 5)], opts)
    input = system ++ [4 | tokens(79, 5)]
    assert {:ok, shared} = Sidecar.generate(conn, second, input, opts)
    assert %{reused_tokens: 40, shared_tokens: 40, prefill_tokens: 6} = shared.stats
    assert {:ok, fresh} = fresh_generate(cold, input, opts)
    assert fresh.stats.reused_tokens == 0 and shared.token_ids == fresh.token_ids
    assert {:ok, %{"models" => %{"default" => %{"shared_prefixes" => n}}}} = Sidecar.stats(conn)
    assert n >= 1
    :ok = Sidecar.close_session(conn, first)
    :ok = Sidecar.close_session(conn, second)
  end

  test "reuse: :shift reuses a window that slid, the rolling case the default recomputes", %{
    conn: conn,
    cold: cold
  } do
    [a, b, c, d] = for {marker, seed} <- Enum.zip([3, 4, 5, 6], 1..4), do: [marker | tokens(seed, 19)]
    {:ok, session} = Sidecar.open_session(conn)
    opts = [max_new_tokens: 8, eos_token_id: []]
    assert {:ok, earlier} = Sidecar.generate(conn, session, a ++ b ++ c, opts)

    # the window drops `a` and goes on after the answer; all but the answer's last token is cached
    window = b ++ c ++ earlier.token_ids ++ d
    assert {:ok, shifted} = Sidecar.generate(conn, session, window, [reuse: :shift, keep: 0] ++ opts)
    assert %{reused_tokens: 47, shifted_tokens: 47, prefill_tokens: 21} = shifted.stats
    assert length(shifted.token_ids) == 8

    assert {:ok, exact} = fresh_generate(cold, window, opts)
    assert %{reused_tokens: 0, shifted_tokens: 0} = exact.stats

    assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "keep"}}} =
             Sidecar.generate(conn, session, window, keep: 4)

    :ok = Sidecar.close_session(conn, session)
  end

  # {first call, second call, tokens the second call must reuse}
  defp petals_case(:prefix, [a, b, _, _]), do: {a, a ++ b, 20}
  defp petals_case(:different_suffix, [a, b, c, _]), do: {a ++ b, a ++ c, 20}
  defp petals_case(:rolling, [a, b, c, d]), do: {a ++ b ++ c, b ++ c ++ d, 0}

  describe "chat" do
    test "a conversation sent whole each turn reuses the earlier turns' cache", %{conn: conn} do
      {:ok, session} = Sidecar.open_session(conn)
      assert session.model["chat_templates"] == ["default"]
      opts = [max_new_tokens: 6, eos_token_id: []]

      {history, stats} =
        Enum.reduce(["Hello there!", "Tell me more.", "And then?"], {[], []}, fn question, {history, stats} ->
          messages = history ++ [%{role: :user, content: question}]
          assert {:ok, %{text: answer, stats: turn}} = Sidecar.generate(conn, session, messages, opts)
          {messages ++ [%{role: :assistant, content: answer}], stats ++ [turn]}
        end)

      # Each turn reuses the whole previous turn, its answer included, but for the answer's last
      # token: sampled, it was never fed to the model, so the cache does not hold it.
      assert [0 | reused] = Enum.map(stats, & &1.reused_tokens)
      assert reused == for(turn <- Enum.drop(stats, -1), do: turn.prompt_tokens + turn.generated_tokens - 1)
      assert reused == Enum.sort(reused) and Enum.uniq(reused) == reused

      # and means what it means in a fresh session
      last_turn = Enum.drop(history, -1)
      assert {:ok, again} = Sidecar.generate(conn, session, last_turn, opts)
      assert {:ok, fresh} = fresh_generate(conn, last_turn, opts)

      assert again.token_ids == fresh.token_ids and
               fresh.stats.prompt_tokens == List.last(stats).prompt_tokens

      :ok = Sidecar.close_session(conn, session)
    end

    test "streams, takes the chat options, and names a bad template", %{conn: conn} do
      {:ok, session} = Sidecar.open_session(conn)
      messages = [%{"role" => "user", "content" => "Hi"}]
      opts = [max_new_tokens: 5, eos_token_id: []]

      chunks = conn |> Sidecar.stream(session, messages, opts) |> Enum.to_list()
      {:ok, result} = Sidecar.generate(conn, session, messages, [chat_template: "default"] ++ opts)
      assert Enum.map_join(chunks, & &1.text) == result.text and length(chunks) == 5

      # continuing the assistant's message: its prefix is what a generation prompt would have opened
      partial = messages ++ [%{role: :assistant, content: "Well"}]

      assert {:ok, %{stats: %{prompt_tokens: continued}}} =
               Sidecar.generate(conn, session, partial, [continue_final_message: true] ++ opts)

      assert continued > result.stats.prompt_tokens

      # an assistant's call of tools has no content; tools and the template's variables go with the messages
      calls = [%{type: "function", function: %{name: "where", arguments: %{}}}]

      assert {:ok, %{stats: %{prompt_tokens: _}}} =
               Sidecar.generate(
                 conn,
                 session,
                 messages ++ [%{role: :assistant, tool_calls: calls}, %{role: :tool, content: "here"}],
                 [tools: [%{type: "function", function: %{name: "where"}}]] ++ opts
               )

      assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "chat_template_kwargs"}}} =
               Sidecar.generate(conn, session, messages, [chat_template_kwargs: %{tokenize: false}] ++ opts)

      assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "chat_template"}}} =
               Sidecar.generate(conn, session, messages, [chat_template: "no-such-template"] ++ opts)
    end

    test "a malformed message raises ArgumentError before anything is sent", %{conn: conn} do
      {:ok, session} = Sidecar.open_session(conn)
      sent = :sys.get_state(conn).next_id

      assert_raise ArgumentError, ~r/message 1 has no content/, fn ->
        Sidecar.generate(conn, session, [%{role: "user", content: "Hi"}, %{role: "user", text: "x"}])
      end

      assert_raise ArgumentError, ~r/message 0: content must be a string/, fn ->
        conn |> Sidecar.stream(session, [%{role: "user", content: nil}]) |> Enum.to_list()
      end

      assert_raise ArgumentError, ~r/option :chat_template applies only to a list of messages/, fn ->
        Sidecar.start_generate(conn, session, "Hi", chat_template: "default")
      end

      assert :sys.get_state(conn).next_id == sent
      :ok = Sidecar.close_session(conn, session)
    end
  end

  test "streaming chunks add up to the blocking result", %{conn: conn} do
    {:ok, session} = Sidecar.open_session(conn)

    chunks =
      Sidecar.stream(conn, session, "The sidecar", max_new_tokens: 12, eos_token_id: []) |> Enum.to_list()

    {:ok, result} = Sidecar.generate(conn, session, "The sidecar", max_new_tokens: 12, eos_token_id: [])
    assert length(chunks) == 12
    assert Enum.flat_map(chunks, & &1.token_ids) == result.token_ids
    assert Enum.map_join(chunks, & &1.text) == result.text
  end

  test "halting a stream early cancels the generation", %{conn: conn} do
    {:ok, session} = Sidecar.open_session(conn)

    assert [_, _, _] =
             Sidecar.stream(conn, session, [5, 6], max_new_tokens: 1_800, eos_token_id: []) |> Enum.take(3)

    assert eventually(fn -> match?({:ok, %{"active_generations" => 0}}, Sidecar.stats(conn)) end)
    assert {:ok, %{finish_reason: "length"}} = Sidecar.generate(conn, session, [5, 6], max_new_tokens: 2)
  end

  test "50 concurrent generates across 10 sessions each reach their own caller", %{conn: conn} do
    sessions = for _ <- 1..10, do: elem(Sidecar.open_session(conn), 1)
    opts = [max_new_tokens: 6, eos_token_id: []]

    results =
      1..50
      |> Enum.map(fn i ->
        Task.async(fn ->
          {i, Sidecar.generate(conn, Enum.at(sessions, rem(i, 10)), tokens(i, 5 + rem(i, 7)), opts)}
        end)
      end)
      |> Task.await_many(120_000)

    for {i, {:ok, result}} <- results do
      assert {:ok, expected} = fresh_generate(conn, tokens(i, 5 + rem(i, 7)), opts)
      assert result.token_ids == expected.token_ids, "request #{i} got someone else's reply"
    end

    assert length(results) == 50
  end

  test "cancel returns the tokens produced so far", %{conn: conn} do
    {:ok, session} = Sidecar.open_session(conn)
    {:ok, request} = Sidecar.start_generate(conn, session, [5, 6], max_new_tokens: 1_800, eos_token_id: [])
    ref = request.ref
    for _ <- 1..3, do: assert_receive({Sidecar, ^ref, {:event, _}}, 10_000)
    :ok = Sidecar.cancel(request)
    assert {:error, %Error{reason: :cancelled, details: %{"token_ids" => ids}}} = Sidecar.await(request)
    assert length(ids) >= 3 and length(ids) < 1_800
  end

  test "only the process that started a request awaits it; another's await raises", %{conn: conn} do
    {:ok, session} = Sidecar.open_session(conn)
    {:ok, request} = Sidecar.start_generate(conn, session, [5, 6], max_new_tokens: 8, eos_token_id: [])

    Task.async(fn ->
      assert_raise ArgumentError, ~r/only the process that started a request/, fn ->
        Sidecar.await(request, 500)
      end
    end)
    |> Task.await()

    # the generation was left alone: its starter gets all of it, and nothing after
    assert {:ok, %{token_ids: ids, finish_reason: "length"}} = Sidecar.await(request)
    assert length(ids) == 8
    assert {:messages, []} = Process.info(self(), :messages)

    # awaited once: a second await raises at once (it waited out its timeout, and with :infinity for ever)
    for timeout <- [:infinity, 60_000] do
      assert_raise ArgumentError, ~r/was awaited already/, fn -> Sidecar.await(request, timeout) end
    end

    # one that timed out is given up on: awaiting it again raises too
    {:ok, long} = Sidecar.start_generate(conn, session, [5, 6], max_new_tokens: 1_900, eos_token_id: [])
    assert {:error, %Error{reason: :timeout}} = Sidecar.await(long, 20)
    assert_raise ArgumentError, ~r/was awaited already/, fn -> Sidecar.await(long, :infinity) end

    # a reply already in the mailbox (read by nobody yet) is awaited as usual
    {:ok, short} = Sidecar.start_generate(conn, session, [5, 6], max_new_tokens: 2, eos_token_id: [])
    ref = short.ref
    assert_receive {Sidecar, ^ref, {:reply, _}} = reply, 10_000
    # the connection holds the request no more; its reply waits here
    send(self(), reply)
    assert {:ok, %{token_ids: [_, _]}} = Sidecar.await(short)
    assert {:messages, []} = Process.info(self(), :messages)
  end

  test "a timeout cancels the generation", %{conn: conn} do
    {:ok, session} = Sidecar.open_session(conn)

    assert {:error, %Error{reason: :timeout}} =
             Sidecar.generate(conn, session, [5, 6], max_new_tokens: 1_900, eos_token_id: [], timeout: 50)

    assert eventually(fn -> match?({:ok, %{"active_generations" => 0}}, Sidecar.stats(conn)) end)
  end

  test "a session made for a call that gave up is closed, not left open with a name nobody knows", %{
    conn: conn
  } do
    {:ok, source} = Sidecar.open_session(conn)
    {:ok, %{"sessions" => before}} = Sidecar.stats(conn)

    # timeouts of 0 and 1 ms: some requests are withdrawn unsent, others are sent and their sessions made
    outcomes =
      for timeout <- List.duplicate(0, 10) ++ List.duplicate(1, 20) do
        case Sidecar.open_session(conn, timeout: timeout) do
          {:ok, session} -> Sidecar.close_session(conn, session) && :ok
          {:error, %Error{reason: :timeout}} -> :timeout
        end
      end ++
        for _ <- 1..20 do
          case Sidecar.fork_session(conn, source, timeout: 1) do
            {:ok, fork} -> Sidecar.close_session(conn, fork) && :ok
            {:error, %Error{reason: :timeout}} -> :timeout
          end
        end

    assert :timeout in outcomes

    # before, every session made for a call that timed out stayed open (30 opens, 3 timed out: 3 + 30 sessions)
    assert eventually(fn -> match?({:ok, %{"sessions" => ^before}}, Sidecar.stats(conn)) end),
           "sessions left open: #{inspect(Sidecar.stats(conn))}, #{before} before"

    assert sidecar_messages() == []
    Sidecar.close_session(conn, source)
  end

  test "a session made for a caller that died while its reply waited in the connection's mailbox is closed",
       %{
         conn: conn
       } do
    {:ok, source} = Sidecar.open_session(conn)
    {:ok, %{"sessions" => before}} = Sidecar.stats(conn)
    {:ok, request} = Sidecar.start_generate(conn, source, [5, 6], max_new_tokens: 10, eos_token_id: [])
    forker = spawn(fn -> Sidecar.fork_session(conn, source) end)

    fork_id =
      eventually(fn ->
        Enum.find_value(:sys.get_state(conn).pending, fn {id, entry} -> entry.op == "fork_session" && id end)
      end)

    # the connection reads nothing while the fork's reply arrives; its caller then dies, so the :DOWN
    # comes behind the reply (under load, 10 of 200 killed openers left sessions open this way)
    :sys.suspend(conn)
    assert eventually(fn -> reply_waiting?(conn, fork_id) end, 30_000)
    Process.exit(forker, :kill)
    :sys.resume(conn)

    assert {:ok, _} = Sidecar.await(request)

    assert eventually(fn -> match?({:ok, %{"sessions" => ^before}}, Sidecar.stats(conn)) end),
           "sessions left open: #{inspect(Sidecar.stats(conn))}, #{before} before"

    Sidecar.close_session(conn, source)
  end

  test "a session whose reply reached its caller, killed before it could take it, is closed", %{conn: conn} do
    {:ok, %{"sessions" => before}} = Sidecar.stats(conn)

    # the sidecar holds the open until the opener is suspended: the reply then lands in its mailbox,
    # which it never reads, as it is killed first
    opener =
      while_sidecar_stopped(conn, fn ->
        opener = spawn(fn -> Sidecar.open_session(conn) end)
        assert eventually(fn -> map_size(:sys.get_state(conn).pending) == 1 end)
        :erlang.suspend_process(opener)
        opener
      end)

    assert eventually(fn -> :sys.get_state(conn).pending == %{} end)
    Process.exit(opener, :kill)

    assert eventually(fn -> match?({:ok, %{"sessions" => ^before}}, Sidecar.stats(conn)) end),
           "sessions left open: #{inspect(Sidecar.stats(conn))}, #{before} before"
  end

  test "sessions made for 80 callers that gave up at once, their replies before their withdrawals, are closed",
       %{conn: conn} do
    {:ok, %{"sessions" => before}} = Sidecar.stats(conn)
    me = self()

    # the sidecar holds the 80 opens; the connection then reads nothing while their replies come, and
    # the callers give up meanwhile: their withdrawals queue behind the replies (a list of the last 64
    # sessions made let 16 of them stay open)
    callers =
      while_sidecar_stopped(conn, fn ->
        callers =
          for _ <- 1..80 do
            # each lives on: a caller's death closes its session by another way
            spawn(fn ->
              send(me, {:opened, Sidecar.open_session(conn, timeout: 6_000)})
              Process.sleep(:infinity)
            end)
          end

        assert eventually(fn -> map_size(:sys.get_state(conn).pending) == 80 end)
        :sys.suspend(conn)
        callers
      end)

    # the 80 replies are in the connection's mailbox before the first caller gives up
    assert eventually(fn -> elem(Process.info(conn, :message_queue_len), 1) >= 80 end, 4_000)
    results = for _ <- callers, do: assert_receive({:opened, result}, 10_000) && result
    :sys.resume(conn)
    assert Enum.all?(results, &match?({:error, %Error{reason: :timeout}}, &1))

    assert eventually(fn -> match?({:ok, %{"sessions" => ^before}}, Sidecar.stats(conn)) end),
           "sessions left open: #{inspect(Sidecar.stats(conn))}, #{before} before"

    Enum.each(callers, &Process.exit(&1, :kill))
  end

  # Runs `fun` with the sidecar's OS process stopped (SIGSTOP): requests sent meanwhile wait unanswered.
  defp while_sidecar_stopped(conn, fun) do
    {:ok, %{"os_pid" => os_pid}} = Sidecar.info(conn)
    System.cmd("kill", ["-STOP", "#{os_pid}"])

    try do
      fun.()
    after
      System.cmd("kill", ["-CONT", "#{os_pid}"])
    end
  end

  # Kills `owner`, then finds the session `name` (made since it was owned) still open, and closes it.
  defp assert_owner_exit_leaves_open(conn, owner, name) do
    ref = Process.monitor(owner)
    Process.exit(owner, :kill)
    assert_receive {:DOWN, ^ref, :process, _, _}
    # the connection's :DOWN came with ours; a close it sent would be answered before these
    {:ok, _} = Sidecar.stats(conn)
    assert {:ok, _} = Sidecar.session_info(conn, name)
    :ok = Sidecar.close_session(conn, name)
  end

  describe "a session's owner" do
    test "its exit closes the session and the forks it owns, however it ends; nobody else's does",
         %{conn: conn} do
      {:ok, %{"sessions" => before}} = Sidecar.stats(conn)
      owner = spawn(fn -> receive do: (:stop -> :ok) end)
      {:ok, session} = Sidecar.open_session(conn, owner: owner)
      {:ok, fork} = Sidecar.fork_session(conn, session, owner: owner)
      {:ok, unowned_fork} = Sidecar.fork_session(conn, session)

      {:ok, %{token_ids: [_, _]}} =
        Sidecar.generate(conn, session, [5, 6], max_new_tokens: 2, eos_token_id: [])

      # opened by this process, owned by another: the caller lives on, the owner is killed
      Process.exit(owner, :kill)

      assert eventually(fn ->
               match?({:error, %Error{reason: :unknown_session}}, Sidecar.session_info(conn, fork))
             end)

      assert {:error, %Error{reason: :unknown_session}} = Sidecar.session_info(conn, session)
      assert {:ok, _} = Sidecar.session_info(conn, unowned_fork)
      :ok = Sidecar.close_session(conn, unowned_fork)

      # a process that owns its own session and returns normally
      task = Task.async(fn -> Sidecar.open_session(conn, owner: self()) end)
      {:ok, its} = Task.await(task)

      assert eventually(fn ->
               match?({:error, %Error{reason: :unknown_session}}, Sidecar.session_info(conn, its))
             end)

      # an owner dead before the call: nothing is made (it was {:ok, session} for a session closed at once)
      dead = spawn(fn -> :ok end)
      ref = Process.monitor(dead)
      assert_receive {:DOWN, ^ref, :process, _, _}
      {:ok, source} = Sidecar.open_session(conn, name: "source-of-dead-owners")

      for call <- [
            fn -> Sidecar.open_session(conn, name: "dead-owners", owner: dead) end,
            fn -> Sidecar.fork_session(conn, source, name: "dead-owners", owner: dead) end
          ] do
        assert {:error, %Error{reason: :owner_exited, message: message}} = call.()
        assert message =~ "has exited: no session was made"
      end

      assert {:error, %Error{reason: :unknown_session}} = Sidecar.session_info(conn, "dead-owners")
      :ok = Sidecar.close_session(conn, source)
      assert {:ok, %{"sessions" => ^before}} = Sidecar.stats(conn)
      assert sidecar_messages() == []
    end

    test "close_session disowns: the connection stops watching the owner, whose exit closes no later session of the name",
         %{conn: conn} do
      owner = spawn(fn -> receive do: (:stop -> :ok) end)
      {:monitors, watched} = Process.info(conn, :monitors)

      for _ <- 1..20 do
        {:ok, _} = Sidecar.open_session(conn, name: "owned-then-closed", owner: owner)
        :ok = Sidecar.close_session(conn, "owned-then-closed")
      end

      # a long-lived owner that opens and closes sessions leaves no monitor behind for each
      assert {:monitors, ^watched} = Process.info(conn, :monitors)
      {:ok, _} = Sidecar.open_session(conn, name: "owned-then-closed")
      assert_owner_exit_leaves_open(conn, owner, "owned-then-closed")
    end

    test "an unload disowns the sessions it closed: the owner's exit closes no later session of a name",
         %{conn: conn} do
      {:monitors, watched} = Process.info(conn, :monitors)
      {:ok, _} = Sidecar.load_model(conn, name: "owned-model", device: "cpu")
      owner = spawn(fn -> receive do: (:stop -> :ok) end)
      {:ok, _} = Sidecar.open_session(conn, model: "owned-model", name: "owned-unloaded", owner: owner)
      {:ok, _} = Sidecar.fork_session(conn, "owned-unloaded", name: "owned-unloaded-fork", owner: owner)
      assert :ok = Sidecar.unload_model(conn, "owned-model")
      assert {:monitors, ^watched} = Process.info(conn, :monitors)

      {:ok, _} = Sidecar.open_session(conn, name: "owned-unloaded")
      assert_owner_exit_leaves_open(conn, owner, "owned-unloaded")
    end

    test "owner: is a pid", %{conn: conn} do
      for bad <- [:me, "pid", self() |> :erlang.pid_to_list()] do
        assert_raise ArgumentError, ~r/owner: is the pid whose exit closes the session/, fn ->
          Sidecar.open_session(conn, owner: bad)
        end
      end

      assert_raise ArgumentError, ~r/owner:/, fn -> Sidecar.fork_session(conn, "any", owner: :me) end
    end

    test "a session-making call's timeout is checked before anything is sent", %{conn: conn} do
      for bad <- [-1, 1.5, "1000"] do
        assert_raise ArgumentError, ~r/a timeout is milliseconds/, fn ->
          Sidecar.open_session(conn, timeout: bad)
        end

        assert_raise ArgumentError, ~r/a timeout is milliseconds/, fn ->
          Sidecar.restore_session(conn, "x", timeout: bad)
        end
      end
    end
  end

  defp reply_waiting?(conn, id) do
    {:messages, messages} = Process.info(conn, :messages)

    Enum.any?(messages, fn
      {_port, {:data, frame}} ->
        match?(
          {:ok, %{"id" => ^id} = reply} when not is_map_key(reply, "event"),
          Sidecar.Msgpack.decode(frame)
        )

      _ ->
        false
    end)
  end

  test "a stray message, cast or call to the connection is logged and dropped; the connection and its sessions go on",
       %{
         conn: conn
       } do
    {:ok, session} = Sidecar.open_session(conn)

    log =
      ExUnit.CaptureLog.capture_log(fn ->
        send(conn, {:hello, :world})
        send(conn, :junk)
        GenServer.cast(conn, :junk)
        assert {:error, %Error{reason: :invalid_argument}} = GenServer.call(conn, :junk)
        assert :ok = Sidecar.ping(conn)
      end)

    assert log =~ "ignored an unexpected message: {:hello, :world}"
    assert log =~ "ignored an unexpected cast: :junk" and log =~ "refused an unexpected call: :junk"
    assert {:ok, %{text: _}} = Sidecar.generate(conn, session, "Hi", max_new_tokens: 2)
    Sidecar.close_session(conn, session)
  end

  test "a call that gave up finds no late reply in its mailbox", %{conn: conn} do
    {:ok, session} = Sidecar.open_session(conn)
    long = [max_new_tokens: 1_900, eos_token_id: []]

    # generate: the reply to the cancel that follows its timeout comes later.
    assert {:error, %Error{reason: :timeout}} = Sidecar.generate(conn, session, [5, 6], [timeout: 50] ++ long)

    assert eventually(fn -> match?({:ok, %{"active_generations" => 0}}, Sidecar.stats(conn)) end)
    assert :ok = Sidecar.ping(conn)
    assert sidecar_messages() == []

    # A plain call: session_info waits behind the session's generation. That is cancelled and the
    # connection suspended, so session_info's reply reaches the connection in time but is relayed
    # only after the call timed out.
    test_pid = self()

    spawn_link(fn ->
      {:ok, %{ref: ref} = generation} = Sidecar.start_generate(conn, session, [5, 6], long)
      assert_receive {Sidecar, ^ref, {:event, _}}, 10_000
      send(test_pid, {:generating, generation})
      Sidecar.await(generation)
    end)

    assert_receive {:generating, generation}, 10_000

    spawn_link(fn ->
      Process.sleep(100)
      Sidecar.cancel(generation)
      :sys.suspend(conn)
      Process.sleep(900)
      :sys.resume(conn)
    end)

    assert {:error, %Error{reason: :timeout}} = Sidecar.session_info(conn, session, 600)
    assert :ok = Sidecar.ping(conn)
    assert sidecar_messages() == []
  end

  defp sidecar_messages do
    {:messages, messages} = Process.info(self(), :messages)
    for {Sidecar, _, _} = message <- messages, do: message
  end

  test "the connection's :call_timeout is every call's default; an explicit timeout wins" do
    {:ok, conn} = Sidecar.start_link(sidecar_opts(call_timeout: 200))
    {:ok, session} = Sidecar.open_session(conn, timeout: 60_000)
    long = [max_new_tokens: 1_900, eos_token_id: []]
    idle? = fn -> match?({:ok, %{"active_generations" => 0}}, Sidecar.stats(conn)) end

    {elapsed, result} = :timer.tc(fn -> Sidecar.generate(conn, session, [5, 6], long) end)
    assert {:error, %Error{reason: :timeout}} = result
    assert elapsed < 10_000_000, "the generation ran past call_timeout"
    assert eventually(idle?)

    {:ok, generation} = Sidecar.start_generate(conn, session, [5, 6], long)
    assert {:error, %Error{reason: :timeout}} = Sidecar.await(generation)
    assert eventually(idle?)

    # session_info waits behind the session's generation until that is cancelled.
    {:ok, generation} = Sidecar.start_generate(conn, session, [5, 6], long)
    assert {:error, %Error{reason: :timeout}} = Sidecar.session_info(conn, session)
    waiting = Task.async(fn -> Sidecar.session_info(conn, session, 60_000) end)
    refute Task.yield(waiting, 500)
    :ok = Sidecar.cancel(generation)
    assert {:error, %Error{reason: :cancelled}} = Sidecar.await(generation, 60_000)
    assert {:ok, %{"session" => _}} = Task.await(waiting, 60_000)
    GenServer.stop(conn)
  end

  test "a dead caller's generation is cancelled", %{conn: conn} do
    {:ok, session} = Sidecar.open_session(conn)
    caller = spawn(fn -> Sidecar.generate(conn, session, [5, 6], max_new_tokens: 1_900, eos_token_id: []) end)
    assert eventually(fn -> match?({:ok, %{"active_generations" => 1}}, Sidecar.stats(conn)) end)
    Process.exit(caller, :kill)
    assert eventually(fn -> match?({:ok, %{"active_generations" => 0}}, Sidecar.stats(conn)) end)
  end

  test "a session can be named and used by its name", %{conn: conn} do
    assert {:ok, %Sidecar.Session{name: "chat-1"}} = Sidecar.open_session(conn, name: "chat-1")
    assert {:error, %Error{reason: :session_exists}} = Sidecar.open_session(conn, name: "chat-1")

    assert {:ok, %{token_ids: [_, _]}} =
             Sidecar.generate(conn, "chat-1", [5, 6], max_new_tokens: 2, eos_token_id: [])

    assert {:ok, %{"history_tokens" => 4, "cached_tokens" => 3}} = Sidecar.session_info(conn, "chat-1")

    assert_raise ArgumentError, ~r/:min_new_tokens beside :processors needs :eos_token_id/, fn ->
      Sidecar.generate(conn, "chat-1", "x", min_new_tokens: 2, processors: [])
    end

    # without :processors it changes the model's generation config, whose end tokens the sidecar has
    assert {:ok, %{token_ids: [_, _, _]}} =
             Sidecar.generate(conn, "chat-1", "x", min_new_tokens: 3, max_new_tokens: 3)

    assert :ok = Sidecar.close_session(conn, "chat-1")
    assert {:error, %Error{reason: :unknown_session}} = Sidecar.generate(conn, "chat-1", "x")
  end

  test "a sidecar started without :session_dir forks sessions but neither saves nor restores them",
       %{conn: conn} do
    {:ok, session} = Sidecar.open_session(conn)
    assert {:ok, %Sidecar.Session{} = fork} = Sidecar.fork_session(conn, session)
    assert {:error, %Error{reason: :forbidden}} = Sidecar.save_session(conn, session, "s")
    assert {:error, %Error{reason: :forbidden}} = Sidecar.restore_session(conn, "s")
    for s <- [session, fork], do: :ok = Sidecar.close_session(conn, s)
  end

  test "errors are values", %{conn: conn} do
    {:ok, session} = Sidecar.open_session(conn)

    assert {:error, %Error{reason: :context_overflow, message: message}} =
             Sidecar.generate(conn, session, [5], max_new_tokens: 3_000)

    assert message =~ "2048"

    assert {:error,
            %Error{reason: :limit_exceeded, details: %{"limit" => "max_new_tokens", "value" => 100_000}}} =
             Sidecar.generate(conn, session, [5], max_new_tokens: 100_000)

    assert {:error, %Error{reason: :empty_input}} = Sidecar.generate(conn, session, [])

    assert {:error, %Error{reason: :invalid_processor, message: m}} =
             Sidecar.generate(conn, session, "x", processors: [Sidecar.configure(TopK, k: 0)])

    assert m =~ "'k'"
    :ok = Sidecar.close_session(conn, session)
    assert {:error, %Error{reason: :unknown_session}} = Sidecar.generate(conn, session, "x")
  end

  test "processor configs and Bumblebee options reach the decode loop", %{conn: conn} do
    opts = [max_new_tokens: 10, eos_token_id: []]
    {:ok, plain} = fresh_generate(conn, [9, 10, 11], opts)
    banned = Enum.uniq(plain.token_ids)

    {:ok, suppressed} =
      fresh_generate(
        conn,
        [9, 10, 11],
        opts ++ [processors: [Sidecar.configure(SuppressTokens, token_ids: banned)]]
      )

    assert MapSet.disjoint?(MapSet.new(suppressed.token_ids), MapSet.new(banned))
    {:ok, same} = fresh_generate(conn, [9, 10, 11], opts ++ [suppressed_token_ids: banned])
    assert same.token_ids == suppressed.token_ids

    sampling = opts ++ [strategy: %{type: :multinomial_sampling, top_k: 20}, temperature: 1.5, seed: 5]
    {:ok, one} = fresh_generate(conn, [9, 10, 11], sampling)
    {:ok, two} = fresh_generate(conn, [9, 10, 11], sampling)
    assert one.token_ids == two.token_ids
  end

  describe "several sequences" do
    @opts [max_new_tokens: 6, eos_token_id: []]

    test "beam search returns the best beams, best first, the first as the result", %{conn: conn} do
      beam = %{type: :beam_search, num_beams: 4, num_return_sequences: 3, length_penalty: 1.0}
      assert {:ok, result} = fresh_generate(conn, [9, 10, 11], [strategy: beam] ++ @opts)

      assert [best | _] = result.sequences
      assert length(result.sequences) == 3

      assert {result.text, result.token_ids, result.finish_reason} ==
               {best.text, best.token_ids, best.finish_reason}

      scores = Enum.map(result.sequences, & &1.score)
      assert Enum.all?(scores, &is_float/1) and scores == Enum.sort(scores, :desc)
      assert Enum.all?(result.sequences, &(length(&1.token_ids) == 6))
      assert result.sequences |> Enum.map(& &1.token_ids) |> Enum.uniq() |> length() == 3

      # one beam is greedy search, as in transformers (so no beam score)
      {:ok, greedy} = fresh_generate(conn, [9, 10, 11], @opts)

      assert {:ok, %{token_ids: ids, sequences: [%{score: nil}]}} =
               fresh_generate(conn, [9, 10, 11], [strategy: %{type: :beam_search, num_beams: 1}] ++ @opts)

      assert ids == greedy.token_ids
      assert [%{score: nil}] = greedy.sequences
    end

    test "beam search streams no tokens, only its final result", %{conn: conn} do
      {:ok, session} = Sidecar.open_session(conn)
      opts = [strategy: %{type: :beam_search, num_beams: 3, num_return_sequences: 2}] ++ @opts
      {:ok, %{ref: ref} = request} = Sidecar.start_generate(conn, session, [9, 10, 11], opts)
      assert_receive {Sidecar, ^ref, {:reply, {:ok, %{"sequences" => [_, _]}}}}, 30_000
      refute_received {Sidecar, ^ref, {:event, _}}
      Process.demonitor(request.ref, [:flush])

      # the stream yields each returned sequence whole, once the search is over
      {:ok, result} = Sidecar.generate(conn, session, [9, 10, 11], opts)
      chunks = conn |> Sidecar.stream(session, [9, 10, 11], opts) |> Enum.to_list()

      assert chunks ==
               for(
                 {s, i} <- Enum.with_index(result.sequences),
                 do: %{text: s.text, token_ids: s.token_ids, sequence: i}
               )

      one = [strategy: %{type: :beam_search, num_beams: 3}] ++ @opts

      assert [%{text: text, token_ids: [_, _, _, _, _, _]} = chunk] =
               conn |> Sidecar.stream(session, [9, 10, 11], one) |> Enum.to_list()

      refute Map.has_key?(chunk, :sequence)
      assert {:ok, %{text: ^text}} = Sidecar.generate(conn, session, [9, 10, 11], one)

      # one beam is greedy search, which streams its tokens: each once (they were yielded, then the whole
      # sequence again)
      single = [strategy: %{type: :beam_search, num_beams: 1}] ++ @opts
      {:ok, greedy} = Sidecar.generate(conn, session, [9, 10, 11], single)
      chunks = conn |> Sidecar.stream(session, [9, 10, 11], single) |> Enum.to_list()
      assert length(chunks) == 6 and Enum.flat_map(chunks, & &1.token_ids) == greedy.token_ids
      assert Enum.map_join(chunks, & &1.text) == greedy.text
      :ok = Sidecar.close_session(conn, session)
    end

    test "num_samples: a seed reproduces every sample; the stream tags each token with its sequence",
         %{conn: conn} do
      opts = [strategy: %{type: :multinomial_sampling, num_samples: 3}, temperature: 1.5, seed: 11] ++ @opts
      {:ok, one} = fresh_generate(conn, [9, 10, 11], opts)
      {:ok, two} = fresh_generate(conn, [9, 10, 11], opts)
      assert length(one.sequences) == 3 and one.sequences == two.sequences
      assert Enum.all?(one.sequences, &(&1.score == nil and length(&1.token_ids) == 6))
      assert one.token_ids == hd(one.sequences).token_ids and one.text == hd(one.sequences).text
      assert one.sequences |> Enum.map(& &1.token_ids) |> Enum.uniq() |> length() > 1

      {:ok, session} = Sidecar.open_session(conn)
      chunks = conn |> Sidecar.stream(session, [9, 10, 11], opts) |> Enum.to_list()
      assert length(chunks) == 18 and Enum.all?(chunks, &(&1.sequence in 0..2))

      for {sequence, i} <- Enum.with_index(one.sequences) do
        mine = for %{sequence: ^i} = chunk <- chunks, do: chunk
        assert Enum.map_join(mine, & &1.text) == sequence.text
        assert Enum.flat_map(mine, & &1.token_ids) == sequence.token_ids
      end

      :ok = Sidecar.close_session(conn, session)
    end

    test "logprobs: each token's log-probability under the model, in the result, its sequences and chunks",
         %{conn: conn} do
      opts = [max_new_tokens: 5, eos_token_id: [], logprobs: 3]
      {:ok, greedy} = fresh_generate(conn, [9, 10, 11], opts)
      [sequence] = greedy.sequences
      assert {sequence.logprobs, sequence.top_logprobs} == {greedy.logprobs, greedy.top_logprobs}

      for {token, logprob, top} <- Enum.zip([greedy.token_ids, greedy.logprobs, greedy.top_logprobs]) do
        # greedy with no processor: the token is the model's most likely, reported as such
        assert [{^token, ^logprob}, {_, second}, {_, third}] = top
        assert logprob < 0 and logprob >= second and second >= third
      end

      # the model's distribution, before the temperature: the first step's is the same hot or cold
      sample = fn t -> [strategy: %{type: :multinomial_sampling}, temperature: t, seed: 1] ++ opts end
      {:ok, hot} = fresh_generate(conn, [9, 10, 11], sample.(3.0))
      {:ok, cold} = fresh_generate(conn, [9, 10, 11], sample.(0.3))

      for {id, logprob} <- hd(greedy.top_logprobs),
          other <- [hd(hot.top_logprobs), hd(cold.top_logprobs)] do
        assert {^id, near} = List.keyfind(other, id, 0)
        assert abs(near - logprob) < 1.0e-4
      end

      {:ok, session} = Sidecar.open_session(conn)
      chunks = conn |> Sidecar.stream(session, [9, 10, 11], opts) |> Enum.to_list()
      assert Enum.flat_map(chunks, & &1.token_ids) == greedy.token_ids

      for {chunk, logprob, top} <- Enum.zip([chunks, greedy.logprobs, greedy.top_logprobs]) do
        assert abs(chunk.logprob - logprob) < 1.0e-4 and
                 Enum.map(chunk.top_logprobs, &elem(&1, 0)) == Enum.map(top, &elem(&1, 0))
      end

      {:ok, plain} = Sidecar.generate(conn, session, [9, 10, 11], max_new_tokens: 2)
      assert plain.logprobs == nil and hd(plain.sequences).top_logprobs == nil

      assert {:ok, %{sequences: [%{logprobs: [_, _], top_logprobs: [[{_, _}], [{_, _}]]}]}} =
               Sidecar.generate(conn, session, [9, 10],
                 strategy: %{type: :beam_search},
                 logprobs: 1,
                 max_new_tokens: 2,
                 eos_token_id: []
               )

      assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "logprobs"}}} =
               Sidecar.generate(conn, session, [9, 10], logprobs: 21)

      assert {:error, %Error{reason: :invalid_params, details: %{"param" => "logprobs"}}} =
               Sidecar.generate(conn, session, [9, 10], logprobs: -1)

      :ok = Sidecar.close_session(conn, session)
    end

    test "prompt_logprobs: a prompt's tokens scored as the generated ones were", %{conn: conn} do
      {:ok, greedy} = fresh_generate(conn, [9, 10, 11], max_new_tokens: 4, eos_token_id: [], logprobs: 2)
      prompt = [9, 10, 11] ++ greedy.token_ids
      {:ok, session} = Sidecar.open_session(conn)
      {:ok, _} = Sidecar.generate(conn, session, prompt, max_new_tokens: 1)

      {:ok, scored} = Sidecar.generate(conn, session, prompt, max_new_tokens: 0, prompt_logprobs: 2)

      assert scored.token_ids == [] and scored.stats.reused_tokens == 0
      assert scored.prompt_token_ids == prompt
      assert [nil, _, _ | generated] = scored.prompt_logprobs
      assert [nil | tops] = scored.prompt_top_logprobs
      assert length(tops) == 6 and Enum.all?(tops, &match?([{_, _}, {_, _}], &1))

      # each generated token's, read again as the prompt's
      for {a, b} <- Enum.zip(generated, greedy.logprobs), do: assert(abs(a - b) < 1.0e-4)
      assert Enum.drop(tops, 2) |> Enum.map(&hd/1) |> Enum.map(&elem(&1, 0)) == greedy.token_ids

      {:ok, plain} = Sidecar.generate(conn, session, prompt, max_new_tokens: 1)
      assert plain.prompt_logprobs == nil and plain.stats.reused_tokens == length(prompt) - 1

      assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "prompt_logprobs"}}} =
               Sidecar.generate(conn, session, prompt, prompt_logprobs: 1, reuse: :shift)

      :ok = Sidecar.close_session(conn, session)
    end

    test "combinations the sidecar refuses come back as errors naming the option", %{conn: conn} do
      {:ok, session} = Sidecar.open_session(conn)

      for {strategy, option} <- [
            {%{type: :greedy_search, num_samples: 2}, "num_samples"},
            {%{type: :multinomial_sampling, num_beams: 2}, "num_beams"},
            {%{type: :beam_search, num_beams: 2, num_return_sequences: 3}, "num_return_sequences"},
            {%{type: :beam_search, num_beams: 0}, "num_beams"}
          ] do
        assert {:error, %Error{reason: :invalid_argument, details: %{"option" => ^option}}} =
                 Sidecar.generate(conn, session, [9, 10], strategy: strategy, max_new_tokens: 2)
      end

      assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "stop"}}} =
               Sidecar.generate(conn, session, [9, 10], strategy: %{type: :beam_search}, stop: ["x"])

      assert {:error, %Error{reason: :limit_exceeded, details: %{"limit" => "max_sequences"}}} =
               Sidecar.generate(conn, session, [9, 10],
                 strategy: %{type: :multinomial_sampling, num_samples: 100_000}
               )

      :ok = Sidecar.close_session(conn, session)
    end
  end

  test "a sequence of the last result continues, cut and extended, reusing the cache", %{conn: conn} do
    opts = [max_new_tokens: 4, eos_token_id: []]
    {:ok, session} = Sidecar.open_session(conn)

    assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "continue"}}} =
             Sidecar.generate(conn, session, :continue, opts)

    sampling = [strategy: %{type: :multinomial_sampling, num_samples: 3}, seed: 5] ++ opts
    {:ok, samples} = Sidecar.generate(conn, session, [9, 10, 11, 12], sampling)
    third = Enum.at(samples.sequences, 2)

    {:ok, continued} =
      Sidecar.generate(conn, session, {:continue, sequence: 2, tokens: -1, append: " and"}, opts)

    {:ok, and_ids} = Sidecar.tokenize(conn, " and", add_special_tokens: false)
    full = [9, 10, 11, 12] ++ Enum.drop(third.token_ids, -1) ++ and_ids
    {:ok, expected} = fresh_generate(conn, full, opts)
    assert continued.token_ids == expected.token_ids
    # samples leave their input cached, not the third sample's tokens
    assert continued.stats.reused_tokens == 4 and continued.stats.prompt_tokens == length(full)

    {:ok, again} = Sidecar.generate(conn, session, :continue, opts)
    {:ok, expected} = fresh_generate(conn, full ++ continued.token_ids, opts)
    assert again.token_ids == expected.token_ids
    assert again.stats.reused_tokens == length(full) + 4 - 1

    assert {:error,
            %Error{reason: :sample_mismatch, details: %{"option" => "continue.sequence", "sequences" => 1}}} =
             Sidecar.generate(conn, session, {:continue, sequence: 1}, opts)

    assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "continue.tokens"}}} =
             Sidecar.generate(conn, session, {:continue, tokens: 1_000}, opts)

    assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "continue"}}} =
             Sidecar.generate(conn, session, {:continue, tokens: 2, chars: 2}, opts)

    {:ok, cut} = Sidecar.generate(conn, session, {:continue, chars: 3, append_token_ids: [7]}, opts)
    kept = cut.stats.prompt_tokens - 1
    {:ok, text} = Sidecar.detokenize(conn, Enum.take(full ++ continued.token_ids, kept))
    assert String.length(text) <= 3 and cut.stats.reused_tokens == kept
    :ok = Sidecar.close_session(conn, session)
  end

  test "an option changes its field of the model's generation config and keeps the others, as Bumblebee's configure",
       %{conn: conn} do
    alias Sidecar.Processors.{RepetitionPenalty, Temperature}
    cache = sidecar_opts()[:env] |> Map.new() |> Map.fetch!("SIDECAR_CACHE_DIR")
    [default_dir | _] = Path.wildcard(Path.join(cache, "default-*"))
    root = Path.join(System.tmp_dir!(), "configured-#{System.unique_integer([:positive])}")
    dir = Path.join(root, "model")
    File.mkdir_p!(dir)
    File.cp_r!(default_dir, dir)
    on_exit(fn -> File.rm_rf!(root) end)

    config =
      ~s({"do_sample": true, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.3, "eos_token_id": 2})

    File.write!(Path.join(dir, "generation_config.json"), config)
    {:ok, _} = Sidecar.load_model(conn, name: "configured", path: dir)
    {:ok, session} = Sidecar.open_session(conn, model: "configured")
    opts = [seed: 5, eos_token_id: [], max_new_tokens: 8]

    # the model's penalty and top_k stay when the temperature changes; the same processors, given whole
    assert {:ok, changed} = Sidecar.generate(conn, session, [9, 10, 9, 10], [temperature: 1.3] ++ opts)

    whole = [
      Sidecar.configure(RepetitionPenalty, penalty: 1.3),
      Sidecar.configure(Temperature, temperature: 1.3),
      Sidecar.configure(TopK, k: 20)
    ]

    assert {:ok, given} = Sidecar.generate(conn, session, [9, 10, 9, 10], [processors: whole] ++ opts)
    assert changed.token_ids == given.token_ids

    # a field no option names, by name; temperature 0 is greedy, the model's sampling processors gone with it
    assert {:ok, %{token_ids: by_name}} =
             Sidecar.generate(conn, session, [9, 10, 9, 10], [generation_config: %{top_k: 3}] ++ opts)

    whole = List.replace_at(whole, 1, Sidecar.configure(Temperature, temperature: 0.7))
    whole = List.replace_at(whole, 2, Sidecar.configure(TopK, k: 3))

    assert {:ok, %{token_ids: ^by_name}} =
             Sidecar.generate(conn, session, [9, 10, 9, 10], [processors: whole] ++ opts)

    assert {:ok, %{token_ids: greedy}} =
             Sidecar.generate(conn, session, [9, 10, 9, 10], [temperature: 0] ++ opts)

    assert {:ok, %{token_ids: ^greedy}} =
             Sidecar.generate(
               conn,
               session,
               [9, 10, 9, 10],
               [
                 strategy: %{type: :greedy_search},
                 processors: [Sidecar.configure(RepetitionPenalty, penalty: 1.3)]
               ] ++
                 opts
             )

    # a value the sidecar refuses names the option it came from, the generation config; beside :processors,
    # the option, and the caller's processors by their own index
    assert {:error, %Error{reason: :invalid_argument, details: %{"option" => "generation_config"}}} =
             Sidecar.generate(conn, session, "x", temperature: -1.0)

    assert {:error, %Error{reason: :invalid_processor, details: %{"option" => "temperature"}}} =
             Sidecar.generate(conn, session, "x", temperature: -1.0, processors: [])

    assert {:error,
            %Error{reason: :invalid_processor, details: %{"index" => 1}, message: "processors[1] " <> _}} =
             Sidecar.generate(conn, session, "x", temperature: 0.5, processors: [nil, %TopK{k: -3}])

    assert_raise Error, ~r/^processors\[0\]/, fn ->
      conn |> Sidecar.stream(session, "x", temperature: 0.5, processors: [%TopK{k: -3}]) |> Enum.to_list()
    end

    assert :ok = Sidecar.unload_model(conn, "configured")
  end

  test "load_model takes a device; one this machine lacks is unknown_device", %{conn: conn} do
    # the connection was started with device: "cpu"
    assert {:ok, [%{"name" => "default", "device" => "cpu", "dtype" => dtype}]} = Sidecar.models(conn)
    assert is_binary(dtype)

    assert {:ok, %{"name" => "on-cpu", "device" => "cpu", "dtype" => "float32"}} =
             Sidecar.load_model(conn, name: "on-cpu", device: "cpu", dtype: :f32)

    {:ok, session} = Sidecar.open_session(conn, model: "on-cpu")
    assert session.model["device"] == "cpu"

    assert {:ok, %{token_ids: [_, _]}} =
             Sidecar.generate(conn, session, [9, 10], max_new_tokens: 2, eos_token_id: [])

    assert :ok = Sidecar.unload_model(conn, "on-cpu")
    assert {:error, %Error{reason: :unknown_session}} = Sidecar.session_info(conn, session)

    assert {:error, %Error{reason: :unknown_device, details: %{"available" => available}}} =
             Sidecar.load_model(conn, name: "far-away", device: "cuda:7")

    assert "cpu" in available
    assert {:ok, [%{"name" => "default"}]} = Sidecar.models(conn)

    assert_raise ArgumentError, ~r/unknown load_model option :devise/, fn ->
      Sidecar.load_model(conn, devise: "cpu")
    end

    assert_raise ArgumentError, ~r/load_model option :device must be/, fn ->
      Sidecar.load_model(conn, device: 0)
    end
  end

  test "load_model takes a prefill_chunk up to the sidecar's", %{conn: conn} do
    assert {:ok, %{"name" => "chunked", "prefill_chunk" => 8}} =
             Sidecar.load_model(conn, name: "chunked", prefill_chunk: 8)

    {:ok, session} = Sidecar.open_session(conn, model: "chunked")

    assert {:ok, %{token_ids: [_, _]}} =
             Sidecar.generate(conn, session, Enum.to_list(5..40), max_new_tokens: 2, eos_token_id: [])

    assert :ok = Sidecar.unload_model(conn, "chunked")

    assert {:error, %Error{reason: :limit_exceeded, details: %{"limit" => "prefill_chunk", "max" => 512}}} =
             Sidecar.load_model(conn, name: "over", prefill_chunk: 513)

    for bad <- [0, -1, 1.5, "8"] do
      assert_raise ArgumentError,
                   ~r/load_model option :prefill_chunk must be a positive integer or nil/,
                   fn ->
                     Sidecar.load_model(conn, name: "bad", prefill_chunk: bad)
                   end
    end

    assert {:ok, [%{"name" => "default", "prefill_chunk" => 512}]} = Sidecar.models(conn)
  end

  test "the sidecar's stderr goes to Logger" do
    log =
      ExUnit.CaptureLog.capture_log(fn ->
        {:ok, conn} = Sidecar.start_link(sidecar_opts(model: nil))
        :ok = Sidecar.ping(conn)
        GenServer.stop(conn)
      end)

    assert log =~ "[sidecar]" and log =~ "serving on fds 3,4"
  end
end
