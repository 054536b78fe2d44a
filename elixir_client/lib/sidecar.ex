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

  A session is the `%Sidecar.Session{}` that `open_session/2` returns, or just its name (a string).
  With the struct, calls on a session of a sidecar that has since died return `:session_lost`.

  Every failure is a value, `{:error, %Sidecar.Error{}}`. If the Python process dies, in-flight
  callers get `reason: :sidecar_exited` and the connection stops for its supervisor to restart it.
  Sessions of the dead sidecar then answer `reason: :session_lost`. If the connection process dies,
  its Port closes and the Python process exits.
  """

  alias Sidecar.{Connection, Error, Generation, Options, Processors}

  @type conn :: GenServer.server()
  @type result :: %{text: String.t(), token_ids: [non_neg_integer()], finish_reason: String.t(), stats: map()}

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
    @moduledoc "A generation started with `Sidecar.start_generate/3`."
    @enforce_keys [:conn, :ref, :id, :monitor]
    defstruct [:conn, :ref, :id, :monitor]
    @type t :: %__MODULE__{}
  end

  @doc "A child spec for supervision trees; see `start_link/1` for the options."
  @spec child_spec(keyword()) :: Supervisor.child_spec()
  def child_spec(opts) do
    %{id: Keyword.get(opts, :name, __MODULE__), start: {__MODULE__, :start_link, [opts]}, type: :worker}
  end

  @doc """
  Starts the sidecar and the process that owns its Port, and returns once the model is loaded and
  the sidecar has answered `hello`. Options (validated up front; bad ones raise `ArgumentError`):

  #{Enum.map_join(Options.definitions(), "\n", fn {k, d} -> "  * `#{inspect(k)}` - #{d[:doc]} (default: `#{inspect(d[:default])}`)" end)}
  """
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts \\ []), do: opts |> Options.validate!() |> Connection.start_link()

  @doc "Round trip to the sidecar."
  @spec ping(conn(), timeout()) :: :ok | {:error, Error.t()}
  def ping(conn, timeout \\ 5_000) do
    with {:ok, _} <- call(conn, "ping", %{}, nil, timeout), do: :ok
  end

  @doc "The sidecar's `hello` answer (versions, capabilities, limits, models) and its OS pid."
  @spec info(conn()) :: map()
  def info(conn), do: GenServer.call(conn, :info)

  @doc "Opens a session on `model` (default `\"default\"`); `name:` lets you choose its name."
  @spec open_session(conn(), keyword()) :: {:ok, Session.t()} | {:error, Error.t()}
  def open_session(conn, opts \\ []) do
    params = %{"model" => Keyword.get(opts, :model, "default"), "session" => Keyword.get(opts, :name)}

    with {:ok, incarnation} <- incarnation(conn),
         {:ok, %{"session" => name, "model" => model}} <-
           call(conn, "open_session", params, nil, Keyword.get(opts, :timeout, 60_000)) do
      {:ok,
       %Session{
         name: name,
         model: model,
         eos_token_ids: model["eos_token_ids"],
         incarnation: incarnation
       }}
    end
  end

  @doc "Closes a session and frees its cache."
  @spec close_session(conn(), session(), timeout()) :: :ok | {:error, Error.t()}
  def close_session(conn, session, timeout \\ 60_000) do
    with {:ok, _} <- session_call(conn, session, "close_session", %{}, timeout), do: :ok
  end

  @doc "What the session holds: history and cached token counts, cache bytes."
  @spec session_info(conn(), session(), timeout()) :: {:ok, map()} | {:error, Error.t()}
  def session_info(conn, session, timeout \\ 60_000),
    do: session_call(conn, session, "session_info", %{}, timeout)

  @doc """
  Generates from `input` (a string or a list of token ids) and waits for the result. Options are
  Bumblebee's generation options, listed in `Sidecar.Generation`. Past `:timeout` the generation
  is cancelled and `{:error, %Sidecar.Error{reason: :timeout}}` returned.
  """
  @spec generate(conn(), session(), String.t() | [non_neg_integer()], keyword()) ::
          {:ok, result()} | {:error, Error.t()}
  def generate(conn, session, input, opts \\ []) do
    with {:ok, request} <- start_request(conn, session, input, opts, false) do
      await(request, Keyword.get(opts, :timeout, 60_000))
    end
  end

  @doc """
  Starts a generation without waiting. The caller receives `{Sidecar, ref, {:event, map}}` for each
  token and one `{Sidecar, ref, {:reply, result}}`. Pass the request to `await/2` or `cancel/1`.
  """
  @spec start_generate(conn(), session(), String.t() | [non_neg_integer()], keyword()) ::
          {:ok, Request.t()} | {:error, Error.t()}
  def start_generate(conn, session, input, opts \\ []), do: start_request(conn, session, input, opts, true)

  @doc "Waits for a started generation; past `timeout` it is cancelled."
  @spec await(Request.t(), timeout()) :: {:ok, result()} | {:error, Error.t()}
  def await(%Request{} = request, timeout \\ 60_000) do
    case receive_reply(request, deadline(timeout)) do
      :timeout ->
        cancel(request)
        {:error, Error.new(:timeout, "the generation did not finish in time and was cancelled")}

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
  A lazy `Stream` of chunks `%{text: String.t(), token_ids: [integer]}` for a LiveView or any
  consumer. The generation starts when the stream is run; halting it early (`Enum.take/2`, a
  `:halt` in `Stream.transform/3` ...) cancels the generation. An error raises `Sidecar.Error`.
  """
  @spec stream(conn(), session(), String.t() | [non_neg_integer()], keyword()) :: Enumerable.t()
  def stream(conn, session, input, opts \\ []) do
    timeout = Keyword.get(opts, :timeout, 60_000)

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

        {%Request{ref: ref, monitor: monitor} = request, false} ->
          receive do
            {Sidecar, ^ref, {:event, %{"token_ids" => ids, "text" => text}}} ->
              {[%{text: text, token_ids: ids}], {request, false}}

            {Sidecar, ^ref, {:reply, {:ok, _}}} ->
              {:halt, {request, true}}

            {Sidecar, ^ref, {:reply, {:error, error}}} ->
              raise error

            {:DOWN, ^monitor, :process, _, _} ->
              raise Error.new(:sidecar_exited, "the sidecar connection went down")
          after
            timeout ->
              cancel(request)
              raise Error.new(:timeout, "no token within #{timeout} ms; the generation was cancelled")
          end
      end,
      fn
        {request, true} ->
          Process.demonitor(request.monitor, [:flush])

        {request, false} ->
          cancel(request)
          GenServer.cast(request.conn, {:forget, request.id})
          Process.demonitor(request.monitor, [:flush])
          flush(request.ref)
      end
    )
  end

  @doc "Token ids of `text` under the model's tokenizer."
  @spec tokenize(conn(), String.t(), keyword()) :: {:ok, [non_neg_integer()]} | {:error, Error.t()}
  def tokenize(conn, text, opts \\ []) do
    params = %{
      "text" => text,
      "model" => Keyword.get(opts, :model, "default"),
      "add_special_tokens" => Keyword.get(opts, :add_special_tokens, true)
    }

    with {:ok, %{"token_ids" => ids}} <-
           call(conn, "tokenize", params, nil, Keyword.get(opts, :timeout, 60_000)),
         do: {:ok, ids}
  end

  @doc "The text of `token_ids`."
  @spec detokenize(conn(), [non_neg_integer()], keyword()) :: {:ok, String.t()} | {:error, Error.t()}
  def detokenize(conn, token_ids, opts \\ []) do
    params = %{
      "token_ids" => token_ids,
      "model" => Keyword.get(opts, :model, "default"),
      "skip_special_tokens" => Keyword.get(opts, :skip_special_tokens, true)
    }

    with {:ok, %{"text" => text}} <-
           call(conn, "detokenize", params, nil, Keyword.get(opts, :timeout, 60_000)),
         do: {:ok, text}
  end

  @doc "Engine statistics: per-model sessions, cached tokens and bytes, evictions; requests in flight."
  @spec stats(conn(), timeout()) :: {:ok, map()} | {:error, Error.t()}
  def stats(conn, timeout \\ 5_000), do: call(conn, "stats", %{}, nil, timeout)

  @doc "Builds or updates a processor config, like `Bumblebee.configure/2`. See `Sidecar.Processors`."
  @spec configure(module() | struct(), keyword()) :: struct()
  def configure(module_or_config, opts \\ []), do: Processors.configure(module_or_config, opts)

  # ---- plumbing ---------------------------------------------------------------------------------

  defp start_request(conn, session, input, opts, stream?) do
    {name, eos_token_ids, incarnation} = identify(session)

    params =
      input
      |> Generation.params(opts, eos_token_ids)
      |> Map.merge(%{"session" => name, "stream" => stream?})

    request(conn, "generate", params, incarnation)
  end

  defp session_call(conn, session, op, params, timeout) do
    {name, _eos, incarnation} = identify(session)
    call(conn, op, Map.put(params, "session", name), incarnation, timeout)
  end

  # A bare name has no incarnation (no :session_lost detection) and leaves EOS to the sidecar's default.
  defp identify(%Session{name: name, eos_token_ids: eos, incarnation: incarnation}),
    do: {name, eos, incarnation}

  defp identify(name) when is_binary(name), do: {name, nil, nil}

  defp call(conn, op, params, incarnation, timeout) do
    with {:ok, request} <- request(conn, op, params, incarnation) do
      case receive_reply(request, deadline(timeout)) do
        :timeout ->
          GenServer.cast(request.conn, {:forget, request.id})
          {:error, Error.new(:timeout, "no reply within #{timeout} ms")}

        reply ->
          reply
      end
    end
  end

  # The final reply of a request (its events are skipped), an error if the connection went down,
  # or :timeout, leaving what to do about the request to the caller.
  defp receive_reply(%Request{ref: ref, monitor: monitor} = request, deadline) do
    wait =
      if deadline == :infinity, do: :infinity, else: max(0, deadline - System.monotonic_time(:millisecond))

    receive do
      {Sidecar, ^ref, {:event, _}} ->
        receive_reply(request, deadline)

      {Sidecar, ^ref, {:reply, reply}} ->
        Process.demonitor(monitor, [:flush])
        reply

      {:DOWN, ^monitor, :process, _, _} ->
        {:error, Error.new(:sidecar_exited, "the sidecar connection went down")}
    after
      wait ->
        Process.demonitor(monitor, [:flush])
        :timeout
    end
  end

  defp deadline(:infinity), do: :infinity
  defp deadline(timeout), do: System.monotonic_time(:millisecond) + timeout

  defp request(conn, op, params, incarnation) do
    case whereis(conn) do
      nil ->
        lost(incarnation)

      pid ->
        monitor = Process.monitor(pid)

        try do
          case GenServer.call(pid, {:request, op, params, incarnation}, 30_000) do
            {:ok, ref, id} -> {:ok, %Request{conn: pid, ref: ref, id: id, monitor: monitor}}
            {:error, error} -> Process.demonitor(monitor, [:flush]) && {:error, error}
          end
        catch
          :exit, _ -> Process.demonitor(monitor, [:flush]) && lost(incarnation)
        end
    end
  end

  defp lost(nil), do: {:error, Error.new(:not_running, "the sidecar connection is not running")}

  defp lost(_),
    do: {:error, Error.new(:session_lost, "the session belonged to a sidecar that has since exited")}

  defp whereis(pid) when is_pid(pid), do: if(Process.alive?(pid), do: pid)
  defp whereis(name), do: GenServer.whereis(name)

  defp incarnation(conn) do
    {:ok, info(conn)["incarnation"]}
  catch
    :exit, _ -> {:error, Error.new(:not_running, "the sidecar connection is not running")}
  end

  defp generation_result(
         {:ok, %{"text" => text, "token_ids" => ids, "finish_reason" => finish, "stats" => stats}}
       ) do
    {:ok,
     %{
       text: text,
       token_ids: ids,
       finish_reason: finish,
       stats: Map.new(stats, fn {k, v} -> {String.to_atom(k), v} end)
     }}
  end

  defp generation_result({:error, _} = error), do: error

  defp flush(ref) do
    receive do
      {Sidecar, ^ref, _} -> flush(ref)
    after
      0 -> :ok
    end
  end
end
