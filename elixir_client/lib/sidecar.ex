defmodule Sidecar do
  @moduledoc """
  An OTP client for the Python sidecar: transformers text generation over an Erlang Port.

  Add it to a supervision tree:

      children = [
        {Sidecar, name: MyApp.Sidecar, python: "/srv/venv/bin/python", model: "/models/llama"}
      ]

  then open sessions and generate as you would with Bumblebee:

      {:ok, session} = Sidecar.open_session(MyApp.Sidecar)
      {:ok, %{text: text}} = Sidecar.generate(MyApp.Sidecar, session, "Once upon a time", max_new_tokens: 32)

  or chat, through the model's own chat template:

      messages = [%{role: "system", content: "Be brief."}, %{role: "user", content: "Hi!"}]
      {:ok, %{text: answer}} = Sidecar.generate(MyApp.Sidecar, session, messages, max_new_tokens: 64)

  Several sequences from one prefill, with sampling or beam search (see `Sidecar.Generation`):

      {:ok, %{sequences: samples}} =
        Sidecar.generate(MyApp.Sidecar, session, "Once upon a time",
          strategy: %{type: :multinomial_sampling, top_p: 0.9, num_samples: 3}, seed: 7)

      {:ok, %{text: best, sequences: [%{score: _} | _] = beams}} =
        Sidecar.generate(MyApp.Sidecar, session, "Once upon a time",
          strategy: %{type: :beam_search, num_beams: 4, num_return_sequences: 2})

  `:sequences` lists `%{text, token_ids, finish_reason, score}` maps (`score` for beams only, best
  first); `:text`, `:token_ids` and `:finish_reason` are the first sequence's. `stream/4` tags the
  chunks of several sequences with `sequence: index`.

  More models, on a device of their own (`:device` at start sets the default for every load):

      {:ok, %{"device" => "cuda:0", "dtype" => "bfloat16"}} =
        Sidecar.load_model(MyApp.Sidecar, name: "big", path: "/models/big", device: "cuda:0", dtype: "bf16")

      {:ok, session} = Sidecar.open_session(MyApp.Sidecar, model: "big")

  A session can be forked (its history, continuing the same cache), and saved to the sidecar's `:session_dir`
  to be restored later, also by another sidecar process on that directory:

      {:ok, branch} = Sidecar.fork_session(MyApp.Sidecar, session)
      {:ok, %{"bytes" => _}} = Sidecar.save_session(MyApp.Sidecar, session, "user-42")
      {:ok, restored} = Sidecar.restore_session(MyApp.Sidecar, "user-42")

  A session is the `%Sidecar.Session{}` that `open_session/2` returns, or just its name (a string).
  With the struct, calls on a session of a sidecar that has since died return `:session_lost` (or
  `:not_running` while no connection runs under the name at all).
  A session lives until closed, unless it has an owner, a process whose exit closes it (a LiveView's
  session, opened in `mount/3`, goes with the LiveView however it ends):

      {:ok, session} = Sidecar.open_session(MyApp.Sidecar, owner: self())

  Calls wait for their reply at most `timeout:` (an option or an argument) milliseconds, by default
  the connection's `:call_timeout`; a generation past it is cancelled. A call that gave up never
  finds its late reply in the caller's mailbox.

  Every failure is a value, `{:error, %Sidecar.Error{}}`. If the Python process dies, in-flight
  callers get `reason: :sidecar_exited` and the connection stops for its supervisor to restart it,
  with reason `{:shutdown, {:sidecar_exited, status}}` (a `:permanent` child, the default, is restarted;
  a `:transient` one is not).
  Sessions of the dead sidecar then answer `reason: :session_lost`. If the connection process dies,
  its Port closes and the Python process exits.
  """

  alias Sidecar.{Connection, Error, Generation, Options, Processors}

  @hand_over_ms 30_000
  # The longest a name stays unregistered while its supervisor restarts the connection (see whereis/2).
  @restart_gap_ms 100
  # A generation's stats as atoms; a key the protocol does not name stays a string (no atom is made from
  # what the sidecar sends).
  @stats_keys Map.new(
                ~w(prompt_tokens reused_tokens shared_tokens shifted_tokens prefill_tokens generated_tokens ttft_s total_s),
                &{&1, String.to_atom(&1)}
              )

  @type conn :: GenServer.server()
  @typedoc "A token's log-probability: `:neg_infinity` where the model gives it none (a logit of -inf)."
  @type logprob :: float() | :neg_infinity
  @typedoc """
  A generation's result: the first (or best) sequence's `text`, `token_ids` and `finish_reason`,
  every sequence in `sequences` (one but for `num_samples:` or `num_return_sequences:`), and `stats`
  (the protocol's keys as atoms, any other key as the string the sidecar sent). With `:logprobs`, the
  first sequence's `logprobs` and `top_logprobs`; with `:prompt_logprobs`, the prompt's ids and theirs
  (`nil` for the first token); `nil` when not asked.
  """
  @type result :: %{
          text: String.t(),
          token_ids: [non_neg_integer()],
          finish_reason: String.t(),
          sequences: [sequence()],
          stats: map(),
          logprobs: [logprob()] | nil,
          top_logprobs: [[{non_neg_integer(), logprob()}]] | nil,
          prompt_token_ids: [non_neg_integer()] | nil,
          prompt_logprobs: [logprob() | nil] | nil,
          prompt_top_logprobs: [[{non_neg_integer(), logprob()}] | nil] | nil
        }

  @typedoc """
  One generated sequence; `score` is the beam's score with beam search, `nil` otherwise; `logprobs` and
  `top_logprobs` are its tokens' with the `:logprobs` option (`Sidecar.Generation`), `nil` otherwise.
  """
  @type sequence :: %{
          text: String.t(),
          token_ids: [non_neg_integer()],
          finish_reason: String.t(),
          score: float() | nil,
          logprobs: [logprob()] | nil,
          top_logprobs: [[{non_neg_integer(), logprob()}]] | nil
        }

  @typedoc """
  An element of `stream/4`: the text and token of one step. With several sequences (`num_samples:`
  above 1, or `num_return_sequences:` above 1) it also carries `sequence`, the index of the
  sequence it extends.
  """
  @type chunk :: %{
          required(:text) => String.t(),
          required(:token_ids) => [non_neg_integer()],
          optional(:sequence) => non_neg_integer(),
          optional(:logprob) => logprob(),
          optional(:top_logprobs) => [{non_neg_integer(), logprob()}]
        }

  defmodule Session do
    @moduledoc """
    A session of a sidecar: a KV cache reused by prefix across `generate` calls. `incarnation`
    identifies the sidecar process it lives in.
    """
    @enforce_keys [:name, :model, :eos_token_ids, :incarnation]
    defstruct [:name, :model, :eos_token_ids, :incarnation]
    @type t :: %__MODULE__{}
  end

  @type session :: Session.t() | String.t()

  defmodule Request do
    @moduledoc """
    A generation started with `Sidecar.start_generate/4`. `ref` tags its messages, which go to
    `owner`, the process that started it; `timeout` is the connection's `:call_timeout`, the default
    of `Sidecar.await/2`.
    """
    @enforce_keys [:conn, :ref, :id, :timeout, :owner]
    defstruct [:conn, :ref, :id, :timeout, :owner, processor_origins: []]
    @type t :: %__MODULE__{}
  end

  @doc "A child spec for supervision trees; see `start_link/1` for the options."
  @spec child_spec(keyword()) :: Supervisor.child_spec()
  def child_spec(opts) do
    %{
      id: Keyword.get(opts, :name, __MODULE__),
      start: {__MODULE__, :start_link, [opts]},
      type: :worker,
      modules: [Sidecar.Connection]
    }
  end

  @doc """
  Starts the sidecar and the process that owns its Port, and returns once the model is loaded and
  the sidecar has answered `hello`. Options (validated up front; bad ones raise `ArgumentError`):

  #{Enum.map_join(Options.definitions(), "\n", fn {k, d} -> "  * `#{inspect(k)}` - #{Options.doc(k)} (default: `#{inspect(d[:default])}`)" end)}
  """
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts \\ []), do: opts |> Options.validate!() |> Connection.start_link()

  @doc """
  As `start_link/1`, without a link. A start that fails returns `{:error, error}` either way, but
  `start_link/1`, like `GenServer.start_link/3`, also sends its linked caller the exit signal, which
  ends a caller that does not trap exits (a supervisor does, and expects it): start one from a process
  that must outlive a failed start with `start/1`, and monitor it.
  """
  @spec start(keyword()) :: GenServer.on_start()
  def start(opts \\ []), do: opts |> Options.validate!() |> Connection.start()

  @doc "Round trip to the sidecar."
  @spec ping(conn(), timeout()) :: :ok | {:error, Error.t()}
  def ping(conn, timeout \\ 5_000) do
    with {:ok, _} <- call(conn, "ping", %{}, nil, timeout), do: :ok
  end

  @doc """
  The sidecar's `hello` answer (versions, capabilities, limits, models), its OS pid and its
  incarnation. `reason: :not_running` while there is no connection under that name, or when one still
  starting (as while its supervisor restarts it) has not answered within 5 s.
  """
  @spec info(conn()) :: {:ok, map()} | {:error, Error.t()}
  def info(conn), do: info(conn, 5_000, System.monotonic_time(:millisecond))

  defp info(conn, limit, started) do
    case whereis(conn, left(limit, started)) do
      nil -> lost(nil)
      pid -> {:ok, GenServer.call(pid, :info, max(left(limit, started), 1))}
    end
  catch
    :exit, reason ->
      if again?(conn, nil, limit, started, reason), do: info(conn, limit, started), else: lost(nil)
  end

  # The connection's incarnation (the sessions it opens carry it), within a call's timeout.
  defp incarnation(conn, timeout) do
    Options.timeout!(timeout)
    incarnation(conn, hand_over_limit(timeout), System.monotonic_time(:millisecond))
  end

  defp incarnation(conn, limit, started) do
    case whereis(conn, left(limit, started)) do
      nil -> lost(nil)
      pid -> {:ok, GenServer.call(pid, :info, max(left(limit, started), 1))["incarnation"]}
    end
  catch
    :exit, {:timeout, _} ->
      {:error, Error.new(:timeout, "the connection did not answer within #{limit} ms")}

    :exit, reason ->
      if again?(conn, nil, limit, started, reason), do: incarnation(conn, limit, started), else: lost(nil)
  end

  # Whether a call that found the connection under `conn` as it stopped (its sidecar exited: it answers
  # its pending callers, then drains its stderr before it goes) looks the name up again, for the one its
  # supervisor starts next: while `limit` lasts, and only for a call that names no session of it. Another
  # exit (a node down, a process under the name that is no connection) is not retried; a retry waits 2 ms.
  defp again?(conn, incarnation, limit, started, exit_reason) do
    retried = incarnation == nil and not is_pid(conn) and stopped?(exit_reason) and left(limit, started) > 0
    if retried, do: Process.sleep(2)
    retried
  end

  defp stopped?({reason, {GenServer, :call, _}}), do: stopped?(reason)
  defp stopped?(reason) when reason in [:noproc, :normal, :shutdown], do: true
  defp stopped?({:shutdown, _}), do: true
  defp stopped?(_), do: false

  @doc """
  Opens a session on `model` (default `\"default\"`); `name:` lets you choose its name, `timeout:`
  overrides the connection's `:call_timeout`.

  `owner:` a pid whose exit closes the session, as an ETS table goes with its owner: a LiveView that
  opens its session with `owner: self()` in `mount/3` frees it however the LiveView ends, a crash or
  a kill included. Without an owner a session lives until `close_session/3`, or until the sidecar
  exits, whichever process opened it. An owner on this node that has exited already is
  `{:error, %Sidecar.Error{reason: :owner_exited}}`, and nothing is made; one that exits while the call
  runs has the session closed all the same, so that `{:ok, session}` may then name a closed session.
  """
  @spec open_session(conn(), keyword()) :: {:ok, Session.t()} | {:error, Error.t()}
  def open_session(conn, opts \\ []) do
    Options.known!(opts, [:model, :name, :owner, :timeout], "open_session")
    owner = owner!(opts)

    params = %{"model" => Keyword.get(opts, :model, "default"), "session" => new_name!(opts)}
    started = System.monotonic_time(:millisecond)

    with :ok <- owner_alive(owner),
         {:ok, %{"session" => name, "model" => model}, incarnation} <-
           making_session(conn, "open_session", params, opts[:timeout], started, owner),
         do: {:ok, new_session(name, model, incarnation)}
  end

  # A call that makes a session, sent to the connection whose incarnation the session will carry: one
  # that stopped between the two (its sidecar exited) refuses it before the sidecar sees it, and it is
  # made again on the one its supervisor started since, within the call's timeout.
  defp making_session(conn, op, params, timeout, started, owner) do
    Options.timeout!(timeout)

    with {:ok, incarnation} <- incarnation(conn, left(timeout, started)) do
      case call(conn, op, params, incarnation, left(timeout, started), owner) do
        {:ok, reply} ->
          {:ok, reply, incarnation}

        {:error, %Error{reason: :session_lost}} ->
          if not is_pid(conn) and left(hand_over_limit(timeout), started) > 0,
            do: making_session(conn, op, params, timeout, started, owner),
            else: lost(nil)

        error ->
          error
      end
    end
  end

  @doc """
  Closes a session and frees its cache; its owner's exit (`open_session/2`'s `:owner`) closes it no
  more. `timeout` defaults to the connection's `:call_timeout`; a close whose call times out, or
  whose caller exits, still goes ahead.
  """
  @spec close_session(conn(), session(), timeout() | nil) :: :ok | {:error, Error.t()}
  def close_session(conn, session, timeout \\ nil) do
    {name, _eos, incarnation} = identify(session)
    params = %{"session" => name}
    with {:ok, _} <- call(conn, "close_session", params, incarnation, timeout, {:closing, name}), do: :ok
  end

  @doc """
  What the session holds: history and cached token counts, cache bytes. `timeout` defaults to the
  connection's `:call_timeout`.
  """
  @spec session_info(conn(), session(), timeout() | nil) :: {:ok, map()} | {:error, Error.t()}
  def session_info(conn, session, timeout \\ nil),
    do: session_call(conn, session, "session_info", %{}, timeout)

  @doc """
  Forks a session: a new session with its history, continuing the same cache (nothing is recomputed or copied),
  independent from then on. The fork runs in the session's queue, so it sees the session as the
  generations sent before it left it. `name:` chooses the fork's name (default: chosen by the
  sidecar), `owner:` a pid whose exit closes the fork (as for `open_session/2`; the source's owner is
  not the fork's), `timeout:` overrides the connection's `:call_timeout`. The fork comes back as the session
  was given: a `%Sidecar.Session{}` for a `%Sidecar.Session{}`, a name for a name; its token counts
  (the protocol reply's `history_tokens` and `cached_tokens`) are `session_info/3`'s.
  """
  @spec fork_session(conn(), session(), keyword()) :: {:ok, session()} | {:error, Error.t()}
  def fork_session(conn, session, opts \\ []) do
    Options.known!(opts, [:name, :owner, :timeout], "fork_session")
    owner = owner!(opts)

    with :ok <- owner_alive(owner),
         {:ok, %{"session" => name}} <-
           session_call(
             conn,
             session,
             "fork_session",
             %{"new" => new_name!(opts)},
             opts[:timeout],
             owner
           ) do
      {:ok, if(is_binary(session), do: name, else: %Session{session | name: name})}
    end
  end

  @doc """
  Saves a session's history and cache under `name` in the sidecar's `:session_dir` (1 to 128
  letters, digits, `.`, `_` or `-`, starting with a letter or digit; never a path), replacing what
  was saved under that name. It runs in the session's queue, after the generations sent before it.
  Returns `"name"`, `"history_tokens"`, `"cached_tokens"` and `"bytes"` (the file's size). A bad name
  is `:invalid_argument` (`"option" => "name"`); a sidecar started without `:session_dir` answers `:forbidden`. `timeout`
  defaults to the connection's `:call_timeout`.
  """
  @spec save_session(conn(), session(), String.t(), timeout() | nil) :: {:ok, map()} | {:error, Error.t()}
  def save_session(conn, session, name, timeout \\ nil),
    do: session_call(conn, session, "save_session", %{"name" => name!(name, "a saved session's")}, timeout)

  @doc """
  Opens a new session holding what `save_session/4` saved under `name`, also by another sidecar
  process started on the same `:session_dir`. Options: `:model` (default `\"default\"`), `:session`
  (the new session's name; default: chosen by the sidecar), `:owner` (a pid whose exit closes it, as
  for `open_session/2`), `:timeout` (default: the connection's `:call_timeout`). No session saved
  under `name`, or a file saved from another model or dtype, truncated or corrupted, is
  `:invalid_session_file`; a sidecar without `:session_dir` answers
  `:forbidden`. The restored session's token counts are `session_info/3`'s.
  """
  @spec restore_session(conn(), String.t(), keyword()) :: {:ok, Session.t()} | {:error, Error.t()}
  def restore_session(conn, name, opts \\ []) do
    name!(name, "a saved session's")
    Options.known!(opts, [:model, :session, :owner, :timeout], "restore_session")
    owner = owner!(opts)

    params = %{
      "name" => name,
      "model" => Keyword.get(opts, :model, "default"),
      "session" => Keyword.get(opts, :session)
    }

    started = System.monotonic_time(:millisecond)

    with :ok <- owner_alive(owner),
         {:ok, %{"session" => session, "model" => model}, incarnation} <-
           making_session(conn, "restore_session", params, opts[:timeout], started, owner),
         do: {:ok, new_session(session, model, incarnation)}
  end

  @doc """
  Generates from `input` and waits for the result. `input` is a string, a list of token ids, a
  conversation: a list of messages such as `[%{role: "user", content: "Hi"}]`, rendered by the
  model's chat template, or a sequence of the session's last result to continue: `:continue` or
  `{:continue, sequence: i, tokens: k, chars: n, append: text}` (see `Sidecar.Generation`). Send the
  whole conversation each turn (earlier answers as `"assistant"` messages): the session reuses its
  cache for what the previous turns already computed. Options are
  Bumblebee's generation options and the chat options, listed in `Sidecar.Generation`; unknown ones, and
  malformed messages, raise `ArgumentError` before anything is sent; values out of range come back as
  the sidecar's typed errors, naming the parameter. Past `:timeout` (default: the
  connection's `:call_timeout`) the generation is cancelled and
  `{:error, %Sidecar.Error{reason: :timeout}}` returned.
  """
  @spec generate(conn(), session(), Generation.input(), keyword()) ::
          {:ok, result()} | {:error, Error.t()}
  def generate(conn, session, input, opts \\ []) do
    Generation.known!(opts)
    Options.timeout!(opts[:timeout])
    started = System.monotonic_time(:millisecond)

    with {:ok, request} <- start_request(conn, session, input, opts, false) do
      await_until(request, give_up_at(opts[:timeout], request, started))
    end
  end

  @doc """
  Starts a generation from `input` (as in `generate/4`) without waiting. The caller receives
  `{Sidecar, ref, {:event, map}}` for each token (the protocol's `token` event: `"text"`,
  `"token_ids"`, and `"sequence"`, the sequence's index, when `num_samples:` is above 1; beam search
  of more than one beam sends none, and one beam is greedy search) and one
  `{Sidecar, ref, {:reply, result}}`. Pass the request to `await/2` or `cancel/1`. An error read from
  that message is the sidecar's as it is: beside `:processors`, its `details["index"]` counts the
  processors the options made first and skips `nil` entries, where `await/2` (as `generate/4` and
  `stream/4`) names the option, or gives the index in the caller's own list.
  """
  @spec start_generate(conn(), session(), Generation.input(), keyword()) ::
          {:ok, Request.t()} | {:error, Error.t()}
  def start_generate(conn, session, input, opts \\ []), do: start_request(conn, session, input, opts, true)

  @doc """
  Waits for a started generation; past `timeout` (default: the connection's `:call_timeout`) it is
  cancelled and its messages are no longer delivered. Only the process that started it receives its
  messages, so only that process can await it, once: `await` in another process, or a second time,
  raises `ArgumentError` (another process may `cancel/1` it). A starter that reads the messages itself
  instead of awaiting ends with `{Sidecar, ref, {:reply, _}}`, after which it may demonitor `ref`
  (`Process.demonitor(ref, [:flush])`), as `await` does, or receive a `:DOWN` for it when the
  connection stops.
  """
  @spec await(Request.t(), timeout() | nil) :: {:ok, result()} | {:error, Error.t()}
  def await(request, timeout \\ nil)

  def await(%Request{owner: owner}, _timeout) when owner != self() do
    raise ArgumentError,
          "only the process that started a request receives its messages and can await it " <>
            "(#{inspect(owner)}, this is #{inspect(self())}); another process may cancel/1 it"
  end

  def await(%Request{} = request, timeout) do
    Options.timeout!(timeout)
    started = System.monotonic_time(:millisecond)

    unless outstanding?(request) do
      raise ArgumentError,
            "request #{request.id} was awaited already (or given up on): its reply is taken, and a request " <>
              "is awaited once"
    end

    await_until(request, give_up_at(timeout, request, started))
  end

  # Whether the request's reply is still to come, or in the mailbox: the connection holds the request
  # still, or relayed its reply before answering this call (so that the reply is in the mailbox now), or
  # went down while the request was out (its :DOWN is). Not so once the request was awaited: a second
  # await would wait for nothing, for ever with :infinity.
  defp outstanding?(%Request{conn: conn, id: id, ref: ref}) do
    GenServer.call(conn, {:pending?, id}, @hand_over_ms) or in_mailbox?(ref)
  catch
    :exit, _ -> in_mailbox?(ref)
  end

  # Peeks for the request's reply or :DOWN: taken out and sent back to the end of the mailbox, behind the
  # request's own events, which all came before it.
  defp in_mailbox?(ref) do
    receive do
      {Sidecar, ^ref, {:reply, _}} = reply -> send(self(), reply) && true
      {:DOWN, ^ref, :process, _, _} = down -> send(self(), down) && true
    after
      0 -> false
    end
  end

  defp await_until(request, deadline) do
    case receive_reply(request, deadline) do
      :timeout ->
        {:error, Error.new(:timeout, "the generation did not finish in time and was cancelled")}

      {:error, error} ->
        {:error, Generation.blame(error, request.processor_origins)}

      reply ->
        generation_result(reply)
    end
  end

  @doc "Cancels a started generation. Its reply (if still awaited) is `reason: :cancelled` with the tokens so far."
  @spec cancel(Request.t()) :: :ok
  def cancel(%Request{conn: conn, id: id}) do
    GenServer.cast(conn, {:cancel, id})
  end

  @doc """
  A lazy `Stream` of chunks `%{text: String.t(), token_ids: [integer]}` of the generation from
  `input` (as in `generate/4`), for a LiveView or any consumer: one per generated token, whose texts
  add up to the result's `text`. The generation starts when the stream is run; halting it early
  (`Enum.take/2`, a `:halt` in `Stream.transform/3` ...) cancels the generation. `:timeout` (default:
  the connection's `:call_timeout`) bounds the wait for each chunk. An error raises `Sidecar.Error`.
  Events of kinds other than the protocol's `token` are skipped, as the protocol asks of clients.
  (Elixir 1.14's `Stream.zip/2`, when its other stream raises at its first element, starts this one
  a second time and halts that second run only: the first generation goes on to its end, its events
  left in the caller's mailbox. Do not zip a generation's stream with one that may raise.)

  With several sequences each chunk also carries `sequence:`, the index of the sequence it extends
  (`%{text: "a", token_ids: [64], sequence: 2}`); the chunks of one sequence add up to its text.
  Samples (`num_samples:`) are streamed token by token, interleaved. Beam search of more than one beam
  (one beam is greedy search, streamed as such) streams no tokens:
  its stream yields, once the search is over, one chunk per returned sequence with all of its text
  and tokens (tagged with `sequence:` when `num_return_sequences:` is above 1), best first.
  """
  @spec stream(conn(), session(), Generation.input(), keyword()) :: Enumerable.t()
  def stream(conn, session, input, opts \\ []) do
    Generation.known!(opts)
    unstreamed? = Generation.unstreamed?(opts)

    Stream.resource(
      fn ->
        case start_generate(conn, session, input, opts) do
          {:ok, request} -> {request, false}
          {:error, error} -> raise error
        end
      end,
      fn
        {request, true} ->
          {:halt, {request, true}}

        {%Request{ref: ref} = request, false} ->
          timeout = opts[:timeout] || request.timeout

          receive do
            {Sidecar, ^ref, {:event, %{"event" => "token", "token_ids" => ids, "text" => text} = event}} ->
              chunk = put_sequence(%{text: text, token_ids: ids}, event["sequence"])
              {[put_logprobs(chunk, event)], {request, false}}

            # an event of a kind this client does not know (a later protocol version's): nothing to yield
            {Sidecar, ^ref, {:event, _}} ->
              {[], {request, false}}

            {Sidecar, ^ref, {:reply, {:ok, result}}} when unstreamed? ->
              Process.demonitor(ref, [:flush])
              {:ok, %{sequences: sequences}} = generation_result({:ok, result})
              tag? = length(sequences) > 1

              chunks =
                for {s, i} <- Enum.with_index(sequences),
                    do: put_sequence(%{text: s.text, token_ids: s.token_ids}, if(tag?, do: i))

              {chunks, {request, true}}

            {Sidecar, ^ref, {:reply, {:ok, _}}} ->
              {:halt, {request, true}}

            {Sidecar, ^ref, {:reply, {:error, error}}} ->
              raise Generation.blame(error, request.processor_origins)

            {:DOWN, ^ref, :process, _, _} ->
              raise Error.new(:sidecar_exited, "the sidecar connection went down")
          after
            timeout ->
              forget(request)
              raise Error.new(:timeout, "no token within #{timeout} ms; the generation was cancelled")
          end
      end,
      fn
        {request, true} ->
          Process.demonitor(request.ref, [:flush])

        {request, false} ->
          forget(request)
      end
    )
  end

  @doc """
  Loads a model into the sidecar and returns its model info (string keys, as the protocol gives it:
  `"name"`, `"path"`, `"architecture"`, `"vocab_size"`, `"max_context"`, `"eos_token_ids"`,
  `"chat_templates"`, `"device"` such as `"cpu"` or `"cuda:0"`, `"dtype"` in torch's spelling such
  as `"float32"` or `"bfloat16"`, `"prefill_chunk"`, `"generation_defaults"`: what a generate that leaves
  out its strategy, `:max_new_tokens`, processors or stop strings takes from the model's generation
  config). Open sessions on it with `open_session(conn, model: name)`.
  Options:

    * `:name` - the name to refer to it by (default `"default"`, which the sidecar started with
      `model:` already has)
    * `:path` - a model directory (default `nil`: the sidecar's embedded tiny model). Only the model
      the sidecar was started with and directories under its `--model-root` flags may be loaded;
      others are `reason: :forbidden`
    * `:dtype` - `"f32"`, `"f16"` or `"bf16"` (also as atoms; default: as saved in the model)
    * `:device` - `"cpu"`, `"cuda"`, `"cuda:N"` or `"mps"` (also as atoms; default: the sidecar's,
      its `:device` start option). A device this machine does not have is `reason: :unknown_device`,
      whose `details["available"]` lists the ones it has
    * `:trust_remote_code` - run code shipped in the model directory (default `false`; needs a
      sidecar started with `--trust-remote-code`)
    * `:prefill_chunk` - prompt tokens per forward pass of this model (default `nil`: the sidecar's
      `--prefill-chunk`, 512 unless given, which is also the most). The models take their forward
      passes in turn, so a large model given fewer holds the other models' streams for less time
      each pass; more than the sidecar's is `reason: :limit_exceeded`
    * `:timeout` - milliseconds to wait (default: the connection's `:call_timeout`)

  Bad option names or types raise `ArgumentError`. Load failures are errors such as
  `:model_not_found`, `:model_exists`, `:invalid_model` or `:limit_exceeded` (`max_models`).
  """
  @spec load_model(conn(), keyword()) :: {:ok, map()} | {:error, Error.t()}
  def load_model(conn, opts \\ []) do
    {timeout, opts} = Keyword.pop(opts, :timeout)
    call(conn, "load_model", load_model_params(opts), nil, timeout)
  end

  @doc """
  Unloads a model; its sessions are closed and their generations cancelled (their owners' exits close
  nothing any more). It returns once the model's memory is freed, so a `load_model/2` after it does not
  hold two models at once.
  """
  @spec unload_model(conn(), String.t(), timeout() | nil) :: :ok | {:error, Error.t()}
  def unload_model(conn, name, timeout \\ nil) do
    name!(name, "a model's")

    with {:ok, _} <- call(conn, "unload_model", %{"model" => name}, nil, timeout), do: :ok
  end

  @doc "The model info of every loaded model (see `load_model/2`)."
  @spec models(conn(), timeout()) :: {:ok, [map()]} | {:error, Error.t()}
  def models(conn, timeout \\ 5_000) do
    with {:ok, %{"models" => models}} <- call(conn, "models", %{}, nil, timeout), do: {:ok, models}
  end

  @doc "Token ids of `text` under the model's tokenizer. Options: `:model`, `:add_special_tokens`, `:timeout`."
  @spec tokenize(conn(), String.t(), keyword()) :: {:ok, [non_neg_integer()]} | {:error, Error.t()}
  def tokenize(conn, text, opts \\ []) do
    Options.known!(opts, [:model, :add_special_tokens, :timeout], "tokenize")

    unless is_binary(text),
      do: raise(ArgumentError, "the text to tokenize is a string, got #{inspect(text, limit: 8)}")

    params = %{
      "text" => text,
      "model" => Keyword.get(opts, :model, "default"),
      "add_special_tokens" => Keyword.get(opts, :add_special_tokens, true)
    }

    with {:ok, %{"token_ids" => ids}} <-
           call(conn, "tokenize", params, nil, opts[:timeout]),
         do: {:ok, ids}
  end

  @doc "The text of `token_ids`. Options: `:model`, `:skip_special_tokens`, `:timeout`."
  @spec detokenize(conn(), [non_neg_integer()], keyword()) :: {:ok, String.t()} | {:error, Error.t()}
  def detokenize(conn, token_ids, opts \\ []) do
    Options.known!(opts, [:model, :skip_special_tokens, :timeout], "detokenize")

    params = %{
      "token_ids" => token_ids,
      "model" => Keyword.get(opts, :model, "default"),
      "skip_special_tokens" => Keyword.get(opts, :skip_special_tokens, true)
    }

    with {:ok, %{"text" => text}} <-
           call(conn, "detokenize", params, nil, opts[:timeout]),
         do: {:ok, text}
  end

  @doc "Engine statistics: per-model sessions, cached tokens and bytes, evictions; requests in flight."
  @spec stats(conn(), timeout()) :: {:ok, map()} | {:error, Error.t()}
  def stats(conn, timeout \\ 5_000), do: call(conn, "stats", %{}, nil, timeout)

  @doc "Builds or updates a processor config, like `Bumblebee.configure/2`. See `Sidecar.Processors`."
  @spec configure(module() | struct(), keyword()) :: struct()
  def configure(module_or_config, opts \\ []), do: Processors.configure(module_or_config, opts)

  # ---- plumbing ---------------------------------------------------------------------------------

  # {option, check, what it must be}
  @load_model_options [
    {:name, &is_binary/1, "a string"},
    {:path, &Options.path_or_nil?/1, "a directory path or nil"},
    {:dtype, &Options.name_or_nil?/1, "a string, an atom or nil"},
    {:device, &Options.name_or_nil?/1, "a string, an atom or nil"},
    {:trust_remote_code, &is_boolean/1, "true or false"},
    {:prefill_chunk, &Options.positive_or_nil?/1, "a positive integer or nil"}
  ]

  defp load_model_params(opts) do
    # :timeout is taken out before: listed as valid all the same
    Options.known!(opts, [:timeout | for({key, _, _} <- @load_model_options, do: key)], "load_model")

    for {key, ok?, expected} <- @load_model_options, Keyword.has_key?(opts, key), into: %{} do
      value = opts[key]

      unless ok?.(value),
        do:
          raise(ArgumentError, "load_model option #{inspect(key)} must be #{expected}, got #{inspect(value)}")

      {Atom.to_string(key), wire_name(value)}
    end
  end

  defp name!(name, _what) when is_binary(name), do: name
  defp name!(name, what), do: raise(ArgumentError, "#{what} name is a string, got #{inspect(name)}")

  # `name:` of a session to make: a string, or left out for the sidecar to choose
  defp new_name!(opts), do: if(name = opts[:name], do: name!(name, "a session's"))

  defp wire_name(value) when is_atom(value) and value not in [nil, true, false], do: Atom.to_string(value)
  defp wire_name(value), do: value

  defp start_request(conn, session, input, opts, stream?) do
    {name, eos_token_ids, incarnation} = identify(session)

    {origins, params} =
      input
      |> Generation.params(opts, eos_token_ids)
      |> Map.merge(%{"session" => name, "stream" => stream?})
      |> Map.pop(:processor_origins, [])

    # the processors the options made come first: the sidecar's errors about them are the options'
    with {:ok, request} <- request(conn, "generate", params, incarnation, opts[:timeout]),
         do: {:ok, %{request | processor_origins: origins}}
  end

  defp new_session(name, model, incarnation),
    do: %Session{name: name, model: model, eos_token_ids: model["eos_token_ids"], incarnation: incarnation}

  defp session_call(conn, session, op, params, timeout, session_owner \\ nil) do
    {name, _eos, incarnation} = identify(session)
    call(conn, op, Map.put(params, "session", name), incarnation, timeout, session_owner)
  end

  # The `{:owner, pid}` of a call making a session, nil without `:owner`.
  defp owner!(opts) do
    case Keyword.get(opts, :owner) do
      nil -> nil
      pid when is_pid(pid) -> {:owner, pid}
      other -> raise ArgumentError, "owner: is the pid whose exit closes the session, got #{inspect(other)}"
    end
  end

  # An owner on this node that has exited would have its session closed as soon as it is made: none is.
  defp owner_alive({:owner, pid}) when node(pid) == node() do
    if Process.alive?(pid),
      do: :ok,
      else:
        {:error, Error.new(:owner_exited, "the owner #{inspect(pid)} has exited: no session was made for it")}
  end

  defp owner_alive(_remote_or_none), do: :ok

  # A bare name has no incarnation (no :session_lost detection) and leaves EOS to the sidecar's default.
  defp identify(%Session{name: name, eos_token_ids: eos, incarnation: incarnation}),
    do: {name, eos, incarnation}

  defp identify(name) when is_binary(name), do: {name, nil, nil}

  defp identify(other),
    do:
      raise(ArgumentError, "a session is a %Sidecar.Session{} or its name (a string), got #{inspect(other)}")

  # A nil timeout is the connection's :call_timeout, which it hands out with each request it takes.
  # `session_owner`: see `Sidecar.Connection`'s take_request.
  defp call(conn, op, params, incarnation, timeout, session_owner \\ nil) do
    Options.timeout!(timeout)
    started = System.monotonic_time(:millisecond)

    with {:ok, request} <- request(conn, op, params, incarnation, timeout, session_owner) do
      case receive_reply(request, give_up_at(timeout, request, started)) do
        :timeout ->
          {:error, Error.new(:timeout, "no reply within #{timeout || request.timeout} ms")}

        {:ok, _} = reply ->
          # the session it made is ours now: until then, our exit would have it closed
          if Connection.makes_session?(op), do: GenServer.cast(request.conn, {:claimed, request.ref})
          reply

        reply ->
          reply
      end
    end
  end

  # The final reply of a request (its events are skipped), an error if the connection went down,
  # or :timeout, after which nothing more of the request reaches the mailbox; what to do about the
  # request itself is left to the caller.
  defp receive_reply(%Request{ref: ref} = request, deadline) do
    wait =
      if deadline == :infinity, do: :infinity, else: max(0, deadline - System.monotonic_time(:millisecond))

    receive do
      {Sidecar, ^ref, {:event, _}} ->
        receive_reply(request, deadline)

      {Sidecar, ^ref, {:reply, reply}} ->
        Process.demonitor(ref, [:flush])
        reply

      {:DOWN, ^ref, :process, _, _} ->
        # the connection replies before it goes down (a sidecar that exited: `sidecar_exited` with its
        # status), but a reply can stand behind the :DOWN here, put back there by `in_mailbox?/1`
        receive do
          {Sidecar, ^ref, {:reply, reply}} -> reply
        after
          0 -> {:error, Error.new(:sidecar_exited, "the sidecar connection went down")}
        end
    after
      # a reply that came as the wait ended is the call's answer: dropped, it would be lost (a session
      # made for the call left open, its name known to nobody)
      wait ->
        case forget(request) do
          {:reply, reply} -> reply
          :none -> :timeout
        end
    end
  end

  # Removing the monitor deactivates the alias the connection sends to; what it sent before is flushed,
  # and returned if it was the reply (it is the call's answer then). The request is withdrawn: still
  # unsent (the sidecar not reading), it is never sent; a generation already sent is cancelled, since
  # nobody will read it; a session it made, or makes, is closed unless its reply was found here (nobody
  # would know its name).
  defp forget(%Request{conn: conn, ref: ref}) do
    Process.demonitor(ref, [:flush])
    found = flush(ref, :none)
    GenServer.cast(conn, {:withdraw, ref, found != :none})
    found
  end

  # The moment a call that started at `started` gives up. Its own timeout counts from the call, so the
  # time spent handing the request over (a restart under way, say) is part of it; the connection's
  # :call_timeout (no timeout given) counts from the hand-over, the one moment it is known (the
  # hand-over itself waits at most @hand_over_ms).
  defp give_up_at(nil, request, _started), do: deadline(request.timeout, System.monotonic_time(:millisecond))
  defp give_up_at(timeout, _request, started), do: deadline(timeout, started)

  defp deadline(:infinity, _started), do: :infinity
  defp deadline(timeout, started), do: started + timeout

  # What is left of a call's timeout at this moment (nil and :infinity stay what they are).
  defp left(timeout, started) when is_integer(timeout),
    do: max(0, timeout - (System.monotonic_time(:millisecond) - started))

  defp left(timeout, _started), do: timeout

  defp hand_over_limit(timeout) when is_integer(timeout), do: min(timeout, @hand_over_ms)
  defp hand_over_limit(_timeout), do: @hand_over_ms

  # Handing a request over takes no longer than the connection takes to queue it (it never waits for
  # the sidecar to read), or to start (a restart under way); a connection that does not take it within
  # the call's own timeout, or @hand_over_ms, is given up on, the request withdrawn.
  defp request(conn, op, params, incarnation, timeout, session_owner \\ nil) do
    hand_over(
      conn,
      op,
      params,
      incarnation,
      hand_over_limit(timeout),
      System.monotonic_time(:millisecond),
      session_owner
    )
  end

  defp hand_over(conn, op, params, incarnation, limit, handing, session_owner) do
    case whereis(conn, left(limit, handing)) do
      # nothing runs under the name: a session of it is lost too, but no call can do anything until one runs
      nil ->
        lost(nil)

      pid ->
        # The monitor's ref is also an alias of this process, the one the connection sends the
        # request's messages to: they stop arriving once the monitor is removed (`forget/1`).
        ref = :erlang.monitor(:process, pid, alias: :demonitor)

        try do
          with {:ok, body} <-
                 Connection.encode_params(GenServer.call(pid, :encoding, left(limit, handing)), params),
               {:ok, id, call_timeout} <-
                 GenServer.call(
                   pid,
                   {:request, op, body, incarnation, ref, session_owner},
                   left(limit, handing)
                 ) do
            {:ok, %Request{conn: pid, ref: ref, id: id, timeout: call_timeout, owner: self()}}
          else
            {:error, error} ->
              Process.demonitor(ref, [:flush])
              {:error, error}
          end
        catch
          :exit, {:timeout, _} ->
            # the request may still be queued: withdrawn (casts follow the call), it is not sent
            GenServer.cast(pid, {:withdraw, ref, false})
            Process.demonitor(ref, [:flush])

            {:error, Error.new(:timeout, "the connection did not take the request within #{limit} ms")}

          :exit, reason ->
            Process.demonitor(ref, [:flush])

            if again?(conn, incarnation, limit, handing, reason),
              do: hand_over(conn, op, params, incarnation, limit, handing, session_owner),
              else: lost(incarnation)
        end
    end
  end

  defp lost(nil), do: {:error, Error.new(:not_running, "the sidecar connection is not running")}

  defp lost(_),
    do:
      {:error,
       Error.new(
         :session_lost,
         "the session belongs to another connection, or to a sidecar that has since exited"
       )}

  # The connection `conn` stands for, or nil. A name is looked up again for up to @restart_gap_ms (and
  # `limit`): a supervisor that restarts a connection leaves its name unregistered from the old one's
  # exit to the new one's start, which registers it at once (calls then wait for the start); 10 ms
  # measured on a busy machine. A pid stands for itself alone.
  defp whereis(pid, _limit) when is_pid(pid) and node(pid) == node(), do: if(Process.alive?(pid), do: pid)
  # another node's: the monitor and the call tell whether it is there
  defp whereis(pid, _limit) when is_pid(pid), do: pid

  defp whereis(name, limit) do
    unless name?(name) do
      raise ArgumentError,
            "not a connection: #{inspect(name)} (a pid, or a name: an atom, {:global, term}, " <>
              "{:via, module, term} or {atom, node})"
    end

    look_up(name, System.monotonic_time(:millisecond) + min(@restart_gap_ms, limit))
  end

  defp name?(name) when is_atom(name), do: true
  defp name?({:global, _}), do: true
  defp name?({:via, module, _}) when is_atom(module), do: true
  defp name?({name, node}) when is_atom(name) and is_atom(node), do: true
  defp name?(_), do: false

  defp look_up(name, give_up) do
    case GenServer.whereis(name) do
      nil ->
        if System.monotonic_time(:millisecond) < give_up do
          Process.sleep(2)
          look_up(name, give_up)
        end

      found ->
        found
    end
  end

  defp generation_result(
         {:ok, %{"text" => text, "token_ids" => ids, "finish_reason" => finish, "stats" => stats} = result}
       ) do
    sequences =
      case result["sequences"] do
        [_ | _] = sequences ->
          for s <- sequences,
              do: %{
                text: s["text"],
                token_ids: s["token_ids"],
                finish_reason: s["finish_reason"],
                score: s["score"],
                logprobs: s["logprobs"],
                top_logprobs: pairs(s["top_logprobs"])
              }

        # a sidecar older than result.sequences
        _ ->
          [%{text: text, token_ids: ids, finish_reason: finish, score: nil, logprobs: nil, top_logprobs: nil}]
      end

    {:ok,
     %{
       text: text,
       token_ids: ids,
       finish_reason: finish,
       sequences: sequences,
       stats: Map.new(stats, fn {k, v} -> {Map.get(@stats_keys, k, k), v} end),
       logprobs: result["logprobs"],
       top_logprobs: pairs(result["top_logprobs"]),
       prompt_token_ids: result["prompt_token_ids"],
       prompt_logprobs: result["prompt_logprobs"],
       prompt_top_logprobs: pairs(result["prompt_top_logprobs"])
     }}
  end

  defp generation_result({:error, _} = error), do: error

  defp put_sequence(chunk, nil), do: chunk
  defp put_sequence(chunk, index), do: Map.put(chunk, :sequence, index)

  defp put_logprobs(chunk, %{"logprob" => logprob, "top_logprobs" => top}),
    do: Map.merge(chunk, %{logprob: logprob, top_logprobs: Enum.map(top, &List.to_tuple/1)})

  defp put_logprobs(chunk, _event), do: chunk

  # [[id, logprob], ...] for each token, as {id, logprob} tuples
  # (a prompt's first token has none: nil)
  defp pairs(nil), do: nil
  defp pairs(steps), do: for(step <- steps, do: step && Enum.map(step, &List.to_tuple/1))

  # Removes the request's messages from the mailbox; returns its reply if one was among them, else `found`.
  defp flush(ref, found) do
    receive do
      {Sidecar, ^ref, {:reply, reply}} -> flush(ref, {:reply, reply})
      {Sidecar, ^ref, _} -> flush(ref, found)
    after
      0 -> found
    end
  end
end
