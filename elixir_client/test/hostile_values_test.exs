defmodule Sidecar.HostileValuesTest.GatedCodec do
  @moduledoc false
  # Sidecar.Msgpack, except that the parameters of a `tokenize` of "hold" wait until the test opens the gate.
  @behaviour Sidecar.Codec

  @impl true
  def encode(%{"text" => "hold"} = params) do
    wait_for_gate()
    Sidecar.Msgpack.encode(params)
  end

  def encode(term), do: Sidecar.Msgpack.encode(term)

  @impl true
  def decode(binary), do: Sidecar.Msgpack.decode(binary)

  defp wait_for_gate do
    if :ets.lookup(:sidecar_test_gate, :open) == [], do: Process.sleep(10) && wait_for_gate()
  end
end

defmodule Sidecar.HostileValuesTest.FussyCodec do
  @moduledoc false
  # Sidecar.Msgpack, except where an application's codec could fail: on cancel frames, on the text
  # "throw" or "exit", and on reading any reply that holds "xyzzy".
  @behaviour Sidecar.Codec

  @impl true
  def encode(%{"op" => "cancel"}), do: raise("this codec encodes no cancel")
  def encode(%{"text" => "throw"}), do: throw(:oops)
  def encode(%{"text" => "exit"}), do: exit(:oops)
  def encode(term), do: Sidecar.Msgpack.encode(term)

  @impl true
  def decode(binary) do
    if :binary.match(binary, "xyzzy") != :nomatch, do: raise("this codec reads no xyzzy")
    Sidecar.Msgpack.decode(binary)
  end
end

defmodule Sidecar.HostileValuesTest.LaterVersionCodec do
  @moduledoc false
  # Sidecar.Msgpack, except that it reads token events as a later protocol version might send them: the
  # event of a token id divisible by 3 as another kind of event that also has "token_ids" and "text", that
  # of an id leaving 1 as a kind with neither. The others stay token events.
  @behaviour Sidecar.Codec

  @impl true
  def encode(term), do: Sidecar.Msgpack.encode(term)

  @impl true
  def decode(binary) do
    case Sidecar.Msgpack.decode(binary) do
      {:ok, %{"event" => "token", "token_ids" => [id]} = event} when rem(id, 3) == 0 ->
        {:ok, %{event | "event" => "draft"}}

      {:ok, %{"event" => "token", "token_ids" => [id], "id" => request}} when rem(id, 3) == 1 ->
        {:ok, %{"id" => request, "event" => "progress", "done" => 1}}

      decoded ->
        decoded
    end
  end
end

defmodule Sidecar.HostileValuesTest do
  # Values an Elixir caller can write but the wire cannot carry, found by an outside test of the client:
  # each is refused before anything is sent, with a typed error naming it, and the connection goes on.
  use ExUnit.Case, async: false

  import Bitwise
  import Sidecar.Test.Helpers
  alias Sidecar.Error
  alias Sidecar.HostileValuesTest.{FussyCodec, GatedCodec, LaterVersionCodec}

  @moduletag timeout: 120_000

  setup_all do
    conn = start_supervised!({Sidecar, sidecar_opts(args: ["--max-frame-bytes", "100000"])}, id: :hostile)
    {:ok, session} = Sidecar.open_session(conn)
    %{conn: conn, session: session}
  end

  test "an integer msgpack cannot carry is refused, not sent as another number", %{
    conn: conn,
    session: session
  } do
    # 2^64 once went out as 0: an empty generation, reported as a success
    assert {:error, %Error{reason: :invalid_argument, details: %{"param" => "max_new_tokens"}} = error} =
             Sidecar.generate(conn, session, "Hi", max_new_tokens: 1 <<< 64)

    assert error.message =~ "range"

    assert {:error, %Error{reason: :invalid_argument, details: %{"param" => "token_ids"}}} =
             Sidecar.detokenize(conn, [(1 <<< 64) + 65])

    assert {:ok, %{"history_tokens" => 0}} = Sidecar.session_info(conn, session)
  end

  test "an improper list is refused at encoding, naming where it is", %{conn: conn} do
    # the depth check walked it first, with a FunctionClauseError: "cannot encode the request", naming nothing
    assert {:error, %Error{reason: :invalid_argument, details: %{"param" => "token_ids"}} = error} =
             Sidecar.detokenize(conn, [1 | 2])

    assert error.message =~ "an improper list"
  end

  test "a list or map as a map key is refused at encoding, not sent unanswerable", %{
    conn: conn,
    session: session
  } do
    # the sidecar cannot read such a frame, its id included: the caller waited out its whole timeout
    bias = Sidecar.configure(Sidecar.Processors.SequenceBias, sequence_bias: %{[65] => 100.0})

    assert {:error, %Error{reason: :invalid_argument, details: %{"param" => "processors"}} = error} =
             Sidecar.generate(conn, session, "x", max_new_tokens: 2, processors: [bias], timeout: 30_000)

    assert error.message =~ "a list or map as a map key"
    message = %{role: "user", content: "hi", meta: %{%{a: 1} => 1}}

    assert {:error, %Error{reason: :invalid_argument, details: %{"param" => "messages"}}} =
             Sidecar.generate(conn, session, [message], max_new_tokens: 2, timeout: 30_000)

    assert {:ok, %{"history_tokens" => 0}} = Sidecar.session_info(conn, session)
  end

  test "text that is not UTF-8 is refused at once, naming where it is", %{conn: conn, session: session} do
    latin1 = "caf" <> <<0xE9>>

    for {input, opts, param} <- [
          {latin1, [], "prompt"},
          {"Hi", [stop: [latin1]], "stop"},
          {[%{role: "user", content: latin1}], [], "messages"}
        ] do
      # once: an `invalid_msgpack` with no id, and the caller waiting out its whole timeout
      {elapsed, result} =
        :timer.tc(fn -> Sidecar.generate(conn, session, input, [timeout: :infinity] ++ opts) end)

      assert {:error, %Error{reason: :invalid_argument, details: %{"param" => ^param}}} = result
      assert elapsed < 1_000_000
    end

    assert {:error, %Error{reason: :invalid_argument}} = Sidecar.tokenize(conn, <<0xFF>>)
    assert :ok = Sidecar.ping(conn)
  end

  test "a request over the sidecar's max_frame_bytes is refused unsent, whatever sorts before its id",
       %{conn: conn, session: session} do
    big = String.duplicate("a", 200_000)
    # "chat_template" and "continue" sort before "id": the sidecar could not have named the request
    for {input, opts} <- [
          {[%{role: "user", content: "x"}], [chat_template: big]},
          {{:continue, append: big}, []},
          {big, []}
        ] do
      assert {:error,
              %Error{reason: :frame_too_large, message: message, details: %{"limit" => "max_frame_bytes"}}} =
               Sidecar.generate(conn, session, input, [timeout: :infinity] ++ opts)

      assert message =~ "it was not sent"
    end

    assert :ok = Sidecar.ping(conn)
  end

  test "a request is encoded by its caller: one slow to encode holds back no other call" do
    :ets.new(:sidecar_test_gate, [:named_table, :public])
    conn = start_supervised!({Sidecar, sidecar_opts(codec: GatedCodec)}, id: :gated)
    held = Task.async(fn -> Sidecar.tokenize(conn, "hold") end)
    Process.sleep(200)
    # once: the connection encoded every request, and all the others waited for this one
    pinged = Task.async(fn -> Sidecar.ping(conn, 5_000) end)
    assert Task.yield(pinged, 5_000) == {:ok, :ok}
    assert Task.yield(held, 0) == nil
    :ets.insert(:sidecar_test_gate, {:open})
    assert {:ok, [_ | _]} = Task.await(held, 10_000)
  end

  test "nesting deeper than max_depth is refused unsent", %{conn: conn} do
    # past ~1,000 levels the sidecar's reader fails before the id: the caller once waited in vain
    # with the details the sidecar's own refusal has: the parameter and its deepest level (the request
    # map is level 1)
    for depth <- [40, 1_030] do
      deep = Enum.reduce(1..depth, 1, fn _, inner -> [inner] end)
      details = %{"limit" => "max_depth", "max" => 32, "value" => depth + 1, "param" => "token_ids"}

      assert {:error, %Error{reason: :limit_exceeded, details: ^details}} =
               Sidecar.detokenize(conn, deep, timeout: 10_000)
    end

    {:ok, session} = Sidecar.open_session(conn)
    deep = Enum.reduce(1..30, 1, fn _, inner -> [inner] end)
    messages = [%{role: "user", content: "x", deep: deep}]
    details = %{"limit" => "max_depth", "max" => 32, "value" => 33, "param" => "messages"}
    assert {:error, %Error{details: ^details}} = Sidecar.generate(conn, session, messages)
    :ok = Sidecar.close_session(conn, session)
  end

  test "an application codec that fails never takes the connection down" do
    conn = start_supervised!({Sidecar, sidecar_opts(codec: FussyCodec)}, id: :fussy)
    {:ok, session} = Sidecar.open_session(conn)
    # the connection's own frames (hello, cancel) do not go through it: a cancel once crashed it
    {:ok, request} = Sidecar.start_generate(conn, session, "Hello", max_new_tokens: 200, eos_token_id: [])
    :ok = Sidecar.cancel(request)
    cancelled = Sidecar.await(request, 30_000)

    assert match?({:ok, %{finish_reason: "cancelled"}}, cancelled) or
             match?({:error, %Error{reason: :cancelled}}, cancelled)

    # an encoding that throws or exits is the request's error, not the caller's crash or :not_running
    for text <- ["throw", "exit"] do
      assert {:error, %Error{reason: :invalid_argument}} = Sidecar.tokenize(conn, text)
    end

    # a reply it cannot read is lost to its caller (which times out), not to everyone
    {:ok, ids} = Sidecar.tokenize(conn, "xyzzy")
    assert {:error, %Error{reason: :timeout}} = Sidecar.detokenize(conn, ids, timeout: 1_000)
    assert :ok = Sidecar.ping(conn)
    assert {:messages, []} = Process.info(self(), :messages)
  end

  test "arguments of the wrong kind raise ArgumentError", %{conn: conn, session: session} do
    assert_raise ArgumentError, ~r/session/, fn -> Sidecar.generate(conn, nil, "x") end
    assert_raise ArgumentError, ~r/name is a string/, fn -> Sidecar.save_session(conn, session, 5) end
    assert_raise ArgumentError, ~r/name is a string/, fn -> Sidecar.restore_session(conn, :x) end
    assert_raise ArgumentError, ~r/name is a string/, fn -> Sidecar.unload_model(conn, :x) end
    # (helper-89) what tokenize, open_session and fork_session took as atoms, and save_session did not
    assert_raise ArgumentError, ~r/text to tokenize is a string/, fn -> Sidecar.tokenize(conn, :hello) end
    assert_raise ArgumentError, ~r/name is a string/, fn -> Sidecar.open_session(conn, name: :x) end

    assert_raise ArgumentError, ~r/name is a string/, fn ->
      Sidecar.fork_session(conn, session, name: :x)
    end
  end

  test "a bad timeout raises before anything is sent, and no reply arrives later", %{
    conn: conn,
    session: session
  } do
    for timeout <- ["x", 10.5, -1, 4_294_967_296] do
      assert_raise ArgumentError, ~r/timeout/, fn ->
        Sidecar.generate(conn, session, "Hi", max_new_tokens: 2, timeout: timeout)
      end

      assert_raise ArgumentError, ~r/timeout/, fn -> Sidecar.ping(conn, timeout) end
    end

    refute_receive {Sidecar, _, _}, 500
    assert {:ok, %{"history_tokens" => 0}} = Sidecar.session_info(conn, session)
  end

  test "options that are not a keyword list, or unknown to the call, raise", %{conn: conn, session: session} do
    assert_raise ArgumentError, ~r/keyword list/, fn -> Sidecar.generate(conn, session, "Hi", [1, 2]) end

    assert_raise ArgumentError, ~r/keyword list/, fn ->
      Sidecar.generate(conn, session, "Hi", %{max_new_tokens: 2})
    end

    # an improper list: the reading of :timeout (or :strategy) before the check raised "not a proper list"
    improper = [{:max_new_tokens, 1} | :x]

    for call <- [&Sidecar.generate/4, &Sidecar.start_generate/4, &Sidecar.stream/4] do
      assert_raise ArgumentError, ~r/generation options must be a keyword list/, fn ->
        call.(conn, session, "Hi", improper)
      end
    end

    assert_raise ArgumentError, ~r/unknown open_session option :nmae/, fn ->
      Sidecar.open_session(conn, nmae: "x")
    end

    assert_raise ArgumentError, ~r/unknown restore_session option :name/, fn ->
      Sidecar.restore_session(conn, "x", name: "y")
    end

    assert_raise ArgumentError, ~r/unknown tokenize option/, fn ->
      Sidecar.tokenize(conn, "x", add_special: false)
    end

    assert_raise ArgumentError, ~r/unknown fork_session option/, fn ->
      Sidecar.fork_session(conn, session, nmae: "x")
    end
  end

  test "a call made while the sidecar reads nothing gives up at its own timeout, and is never sent" do
    conn = start_supervised!({Sidecar, sidecar_opts()}, id: :stalled)
    {:ok, %{"os_pid" => os_pid}} = Sidecar.info(conn)
    {:ok, first} = Sidecar.open_session(conn)
    {:ok, second} = Sidecar.open_session(conn)
    System.cmd("kill", ["-STOP", "#{os_pid}"])
    # whatever happens below, the sidecar runs again (a stopped one could not see its input close)
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{os_pid}"], stderr_to_stdout: true) end)

    # more than a pipe holds: the rest waits in the connection until the sidecar reads again
    filler =
      Task.async(fn -> Sidecar.generate(conn, first, String.duplicate("a ", 300_000), timeout: :infinity) end)

    Process.sleep(300)
    assert Task.yield(filler, 0) == nil
    # once: every call blocked 30 s, whatever its timeout, then :session_lost, and the request sent
    # after all; a fork is not cancelled by anything, so had it been sent it would have run
    {elapsed, result} =
      :timer.tc(fn -> Sidecar.fork_session(conn, second, name: "late-fork", timeout: 1_000) end)

    assert {:error, %Error{reason: :timeout}} = result
    assert elapsed < 3_000_000
    assert {:ok, _} = Sidecar.info(conn)
    System.cmd("kill", ["-CONT", "#{os_pid}"])

    Task.await(filler, 60_000)
    assert {:ok, _} = Sidecar.open_session(conn, name: "late-fork")
  end

  test "requests waiting unsent are bounded by the sidecar's max_queued_bytes" do
    conn = start_supervised!({Sidecar, sidecar_opts(args: ["--max-queued-bytes", "400000"])}, id: :bounded)
    {:ok, %{"os_pid" => os_pid}} = Sidecar.info(conn)
    sessions = for _ <- 1..3, do: elem(Sidecar.open_session(conn), 1)
    System.cmd("kill", ["-STOP", "#{os_pid}"])
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{os_pid}"], stderr_to_stdout: true) end)
    prompt = String.duplicate("a ", 90_000)

    [fits_the_pipe, waits | _] =
      for s <- sessions, do: Sidecar.start_generate(conn, s, prompt, max_new_tokens: 1)

    assert {:ok, _} = fits_the_pipe
    assert {:ok, _} = waits
    # the third would hold 360,000 bytes unsent (with the 180,000 of the second): over the bound
    assert {:error, %Error{reason: :too_many_requests, details: %{"limit" => "max_queued_bytes"}}} =
             Sidecar.start_generate(conn, List.last(sessions), prompt <> prompt, max_new_tokens: 1)

    # one cancelled while it waits unsent is never sent, and answers as one the sidecar cancelled before
    # it started: nothing produced, every count 0
    {:ok, unsent} = Sidecar.start_generate(conn, List.last(sessions), "Hi", max_new_tokens: 1)
    :ok = Sidecar.cancel(unsent)

    assert {:error, %Error{reason: :cancelled, details: %{"token_ids" => [], "text" => "", "stats" => stats}}} =
             Sidecar.await(unsent, 10_000)

    System.cmd("kill", ["-CONT", "#{os_pid}"])
    # sent once the sidecar reads again, and answered (the prompt is longer than the tiny model's context)
    assert {:error, %Error{reason: :context_overflow}} = Sidecar.await(elem(waits, 1), 60_000)
    {:ok, %{stats: sent}} = Sidecar.generate(conn, List.last(sessions), "Hi", max_new_tokens: 1)
    assert Enum.sort(Map.keys(stats)) == Enum.sort(for key <- Map.keys(sent), do: Atom.to_string(key))
    assert stats["generated_tokens"] == 0 and stats["prefill_tokens"] == 0 and stats["ttft_s"] == nil
  end

  test "a close withdrawn while it waits unsent is still sent: the session it disowned is closed" do
    conn = start_supervised!({Sidecar, sidecar_opts()}, id: :withdrawn_close)
    {:ok, %{"os_pid" => os_pid}} = Sidecar.info(conn)
    owner = spawn(fn -> receive do: (:stop -> :ok) end)
    {:ok, _} = Sidecar.open_session(conn, name: "closed-unsent", owner: owner)
    {:ok, filler} = Sidecar.open_session(conn)
    System.cmd("kill", ["-STOP", "#{os_pid}"])
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{os_pid}"], stderr_to_stdout: true) end)
    # more than a pipe holds: what is sent after it waits in the connection's outbox
    {:ok, big} = Sidecar.start_generate(conn, filler, String.duplicate("a ", 90_000), max_new_tokens: 1)
    assert {:error, %Error{reason: :timeout}} = Sidecar.close_session(conn, "closed-unsent", 200)

    # disowned by the close: the owner's exit closes nothing (the close, dropped unsent, left it open for good)
    Process.exit(owner, :kill)
    System.cmd("kill", ["-CONT", "#{os_pid}"])
    Sidecar.await(big, 60_000)
    assert {:error, %Error{reason: :unknown_session}} = Sidecar.session_info(conn, "closed-unsent")
    assert {:ok, %{"sessions" => 1}} = Sidecar.stats(conn)
  end

  test "a Port that closes without an exit status, frames still unsent, answers every caller" do
    conn = start_supervised!({Sidecar, sidecar_opts()}, id: :port_closed)
    {:ok, %{"os_pid" => os_pid}} = Sidecar.info(conn)
    {:ok, session} = Sidecar.open_session(conn)
    System.cmd("kill", ["-STOP", "#{os_pid}"])
    on_exit(fn -> System.cmd("kill", ["-CONT", "#{os_pid}"], stderr_to_stdout: true) end)
    monitor = Process.monitor(conn)
    prompt = String.duplicate("a ", 100_000)

    # more than a pipe holds: the later ones wait in the connection's outbox
    callers =
      for _ <- 1..3, do: Task.async(fn -> Sidecar.generate(conn, session, prompt, timeout: :infinity) end)

    Process.sleep(300)
    assert Enum.all?(callers, &(Task.yield(&1, 0) == nil))
    # any process may close a Port; it then ends with no exit status, as one whose write failed does
    Port.close(:sys.get_state(conn).port)

    for caller <- callers do
      assert {:error, %Error{reason: :sidecar_exited, message: message}} = Task.await(caller, 10_000)
      assert message =~ "port closed"
    end

    assert_receive {:DOWN, ^monitor, :process, ^conn, {:shutdown, {:sidecar_exited, nil}}}, 10_000
  end

  test "processors that are not processor structs raise ArgumentError", %{conn: conn, session: session} do
    alias Sidecar.Processors.{SequenceBias, TopK}

    for processors <- [[%{name: "top_k"}], [:top_k], [%URI{}], Sidecar.Processors.configure(TopK, k: 2)] do
      assert_raise ArgumentError, fn -> Sidecar.generate(conn, session, "Hi", processors: processors) end
    end

    assert_raise ArgumentError, ~r/keyword list/, fn -> Sidecar.Processors.configure(TopK, [1]) end
    assert_raise ArgumentError, fn -> Sidecar.Processors.configure(TopK, %{k: 2}) end
    # a malformed bias goes to the sidecar, which names it
    bias = Sidecar.Processors.configure(SequenceBias, sequence_bias: [:oops])

    assert {:error, %Error{reason: reason}} = Sidecar.generate(conn, session, "Hi", processors: [bias])
    assert reason in [:invalid_processor, :invalid_params]

    # a bias or transitions that are not lists at all go to the sidecar too (a bias of 5 raised
    # Protocol.UndefinedError in the caller, naming neither the processor nor the option)
    for processor <- [
          Sidecar.Processors.configure(SequenceBias, sequence_bias: 5),
          Sidecar.Processors.configure(SequenceBias, sequence_bias: %{"a" => 1}),
          Sidecar.Processors.configure(Sidecar.Processors.DFA, initial_state: 0, transitions: 5)
        ] do
      assert {:error, %Error{reason: :invalid_processor, message: message}} =
               Sidecar.generate(conn, session, "Hi", processors: [processor])

      assert message =~ ~r/sequence_bias|transitions/
    end
  end

  test "false for an option read when given, or a stop that is not a string, raises ArgumentError",
       %{conn: conn, session: session} do
    # each was sent as if left out (or, for stop, as the atom's name)
    for key <- [
          :temperature,
          :forced_bos_token_id,
          :eos_token_id,
          :min_new_tokens,
          :no_repeat_ngram_length,
          :suppressed_token_ids
        ] do
      assert_raise ArgumentError, ~r/option #{inspect(key)} cannot be false/, fn ->
        Sidecar.generate(conn, session, "Hi", [{key, false}, max_new_tokens: 1])
      end
    end

    for stop <- [:foo, ["a", :b], [1]] do
      assert_raise ArgumentError, ~r/:stop must be a string/, fn ->
        Sidecar.generate(conn, session, "Hi", stop: stop, max_new_tokens: 1)
      end
    end

    # nothing reached the session, and a string stop (or a list of them) still goes through, on a session of
    # its own: the module's session stays empty for the tests that read its history
    assert {:ok, %{"history_tokens" => 0}} = Sidecar.session_info(conn, session)
    {:ok, own} = Sidecar.open_session(conn)

    for stop <- ["x", ["x", "y"]] do
      assert {:ok, _} = Sidecar.generate(conn, own, "Hi", stop: stop, max_new_tokens: 1)
    end

    :ok = Sidecar.close_session(conn, own)
  end

  test "a stream skips events of kinds it does not know, and leaves none of them behind" do
    # they were yielded as tokens when they had "token_ids" and "text", and left in the caller's mailbox
    # when they had not
    conn = start_supervised!({Sidecar, sidecar_opts(codec: LaterVersionCodec)}, id: :later_version)
    {:ok, session} = Sidecar.open_session(conn)
    opts = [max_new_tokens: 24, eos_token_id: [], strategy: %{type: :multinomial_sampling}, seed: 7]
    chunks = Sidecar.stream(conn, session, "The sidecar", opts) |> Enum.to_list()
    {:ok, result} = Sidecar.generate(conn, session, "The sidecar", opts)
    kept = Enum.filter(result.token_ids, &(rem(&1, 3) == 2))

    assert Enum.flat_map(chunks, & &1.token_ids) == kept
    assert Enum.any?(result.token_ids, &(rem(&1, 3) == 0)) and Enum.any?(result.token_ids, &(rem(&1, 3) == 1))
    {:messages, messages} = Process.info(self(), :messages)
    assert [] == for({Sidecar, _, _} = message <- messages, do: message)
  end

  test "start options the OS would refuse raise before anything starts" do
    assert_raise ArgumentError, ~r/:env/, fn ->
      Sidecar.start_link(sidecar_opts(env: [{"A", "x" <> <<0>> <> "y"}]))
    end

    assert_raise ArgumentError, ~r/:env/, fn -> Sidecar.start_link(sidecar_opts(env: [{"A=B", "x"}])) end
    assert_raise ArgumentError, ~r/:args/, fn -> Sidecar.start_link(sidecar_opts(args: ["a" <> <<0>>])) end
    assert_raise ArgumentError, ~r/:cd/, fn -> Sidecar.start_link(sidecar_opts(cd: "/nonexistent/dir")) end
  end
end
