defmodule Sidecar.Options do
  @moduledoc """
  Start options of `Sidecar.start_link/1`, declared once and validated before anything is spawned.
  """

  @definitions [
    python: [
      doc:
        "the Python executable that has the sidecar installed, such as the venv's `/path/to/.venv/bin/python`; the default rarely has it. A wrapper script must `exec` Python: the connection stops the process it started, not that process's children",
      default: "python3"
    ],
    model: [
      doc: ~s(a local model directory, or `:default` for the embedded tiny model, or `nil` to load none),
      default: :default
    ],
    device: [
      doc:
        ~s{where models run unless `load_model/2` names a device: `"cpu"`, `"cuda"`, `"cuda:N"` or `"mps"`; } <>
          ~s{`nil` leaves it to the sidecar (CPU); a device this machine lacks fails the start},
      default: nil,
      flag: "--device"
    ],
    dtype: [
      doc: ~s{dtype of the `model:` loaded at start: `"f32"`, `"f16"` or `"bf16"`; `nil`: as saved},
      default: nil,
      flag: "--dtype"
    ],
    session_dir: [
      doc:
        "a directory (relative to `:cd`, created if missing) where `save_session/4` writes sessions and " <>
          "`restore_session/3` reads them; `nil`: both answer `:forbidden`",
      default: nil,
      flag: "--session-dir"
    ],
    share_prefixes: [
      doc:
        "whether a session continues a prefix another session's cache holds (a shared system prompt) " <>
          "instead of computing it again",
      default: true,
      flag: {:when_false, "--no-share-prefixes"}
    ],
    args: [doc: "extra command-line arguments for `python -m sidecar`", default: []],
    env: [doc: "extra environment variables, as `[{name, value}]` strings", default: []],
    cd: [doc: "working directory of the Python process", default: nil],
    name: [doc: "a name to register the connection under (as in `GenServer.start_link/3`)", default: nil],
    codec: [doc: "the payload codec, a `Sidecar.Codec` implementation", default: Sidecar.Msgpack],
    startup_timeout: [
      doc: "milliseconds to wait for the sidecar to load and answer `hello`",
      default: 120_000
    ],
    call_timeout: [
      doc:
        "default milliseconds a call waits for its reply (`ping/2` and `stats/2`: 5 s); generations past it are cancelled",
      default: 60_000
    ],
    log_stderr: [doc: "forward the Python process's stderr lines to Logger", default: true]
  ]

  # the longest wait `receive ... after` takes (2^32 - 1 ms, 49.7 days)
  @max_timeout 4_294_967_295

  @doc false
  def definitions, do: @definitions

  @doc false
  # An option's documentation line, with the command-line flag it becomes.
  def doc(key) do
    definition = @definitions[key]

    case definition[:flag] do
      nil -> definition[:doc]
      {:when_false, flag} -> "#{definition[:doc]} (`false` passes `#{flag}`)"
      flag -> "#{definition[:doc]} (`#{flag}`)"
    end
  end

  @doc "Validates start options; raises `ArgumentError` naming the offending option."
  @spec validate!(keyword()) :: keyword()
  def validate!(opts) when is_list(opts) do
    unless Keyword.keyword?(opts), do: raise(ArgumentError, "Sidecar start options must be a keyword list")
    valid = Keyword.keys(@definitions)

    for {key, _} <- opts, key not in valid do
      raise ArgumentError,
            "unknown Sidecar start option #{inspect(key)}; valid options: #{Enum.map_join(valid, ", ", &inspect/1)}"
    end

    options = Keyword.merge(Enum.map(@definitions, fn {k, d} -> {k, d[:default]} end), opts)
    Enum.each(options, fn {key, value} -> check!(key, value) end)

    # the sidecar refuses it (a start that exits), as it would otherwise be ignored
    if options[:model] == nil and options[:dtype] != nil,
      do:
        raise(
          ArgumentError,
          "Sidecar option :dtype is the dtype of the model: loaded at start; with model: nil there is none"
        )

    Keyword.update!(options, :python, &resolve_python!/1)
  end

  def validate!(opts),
    do: raise(ArgumentError, "Sidecar start options must be a keyword list, got #{inspect(opts, limit: 5)}")

  defp check!(:python, v) when is_binary(v) and v != "", do: :ok
  defp check!(:model, v) when v in [:default, nil] or (is_binary(v) and v != ""), do: :ok
  defp check!(key, v) when key in [:device, :dtype], do: if(name_or_nil?(v), do: :ok, else: invalid!(key, v))
  defp check!(:session_dir, v) when is_nil(v) or (is_binary(v) and v != ""), do: :ok
  defp check!(:args, v) when is_list(v), do: each!(:args, v, &os_string?/1)

  defp check!(:env, v) when is_list(v),
    do:
      each!(:env, v, fn
        {k, val} -> os_string?(k) and k != "" and not String.contains?(k, "=") and os_string?(val)
        _ -> false
      end)

  defp check!(:cd, nil), do: :ok

  defp check!(:cd, v) when is_binary(v) do
    unless os_string?(v) and File.dir?(v),
      do: raise(ArgumentError, "Sidecar option :cd must be an existing directory, got #{inspect(v)}")

    :ok
  end

  defp check!(:name, v) when is_nil(v) or is_atom(v), do: :ok
  defp check!(:name, {:global, _}), do: :ok

  # GenServer takes any {:via, module, term} and fails in the module's registry functions, naming nothing
  defp check!(:name, {:via, module, _} = v) when is_atom(module) do
    unless Code.ensure_loaded?(module) and function_exported?(module, :register_name, 2) and
             function_exported?(module, :whereis_name, 1),
           do: invalid!(:name, v)

    :ok
  end

  defp check!(:codec, v) when is_atom(v), do: codec!(v)

  defp check!(key, v)
       when key in [:startup_timeout, :call_timeout] and
              ((is_integer(v) and v > 0 and v <= @max_timeout) or v == :infinity),
       do: :ok

  defp check!(key, v) when key in [:log_stderr, :share_prefixes] and is_boolean(v), do: :ok

  defp check!(key, v), do: invalid!(key, v)

  defp invalid!(key, v),
    do:
      raise(
        ArgumentError,
        "invalid value #{inspect(v)} for Sidecar option #{inspect(key)}: #{doc(key)}"
      )

  @doc false
  # A device or dtype name: a non-empty string, an atom (not a boolean), or nil.
  def name_or_nil?(v), do: is_nil(v) or (is_binary(v) and v != "") or (is_atom(v) and not is_boolean(v))

  @doc false
  def path_or_nil?(v), do: is_nil(v) or is_binary(v)

  @doc false
  def positive_or_nil?(v), do: is_nil(v) or (is_integer(v) and v > 0)

  @doc false
  # The command-line flags of the start options that become flags of `python -m sidecar` (their `flag:`).
  @spec flags(keyword()) :: [String.t()]
  def flags(opts) do
    Enum.flat_map(@definitions, fn {key, definition} ->
      case {definition[:flag], opts[key]} do
        {nil, _} -> []
        {{:when_false, flag}, false} -> [flag]
        {{:when_false, _}, _} -> []
        {_, nil} -> []
        {flag, value} -> [flag, to_string(value)]
      end
    end)
  end

  # What the OS takes as an argument, a variable or a path: a string without NUL (open_port refuses
  # one with a bare badarg).
  defp os_string?(v), do: is_binary(v) and not String.contains?(v, <<0>>)

  @doc false
  # The options a call takes: anything else (a typo, an option of another call) raises, never ignored.
  @spec known!(term(), [atom()], String.t()) :: :ok
  def known!(opts, valid, call) do
    unless Keyword.keyword?(opts),
      do: raise(ArgumentError, "#{call} options must be a keyword list, got #{inspect(opts, limit: 5)}")

    for {key, _} <- opts, key not in valid do
      raise ArgumentError,
            "unknown #{call} option #{inspect(key)}; valid options: #{Enum.map_join(valid, ", ", &inspect/1)}"
    end

    :ok
  end

  @doc false
  # Raises when `value` holds an improper list (`[1 | 2]`) anywhere, through lists, maps, tuples and
  # structs: walking it would raise a `FunctionClauseError` deep inside, naming nothing. `name` says
  # what holds it (`"option :stop"`).
  @spec proper!(term(), String.t()) :: :ok
  def proper!(value, name) do
    if improper = improper_in(value),
      do: raise(ArgumentError, "#{name} holds an improper list: #{inspect(improper, limit: 5)}")

    :ok
  end

  defp improper_in([]), do: nil
  defp improper_in([head | tail]) when is_list(tail), do: improper_in(head) || improper_in(tail)
  defp improper_in([_ | _] = list), do: list
  defp improper_in(%_{} = struct), do: struct |> Map.from_struct() |> improper_in()

  defp improper_in(map) when is_map(map),
    do: Enum.find_value(map, fn {key, value} -> improper_in(key) || improper_in(value) end)

  defp improper_in(tuple) when is_tuple(tuple), do: tuple |> Tuple.to_list() |> improper_in()
  defp improper_in(_), do: nil

  @doc false
  # A call's `timeout`: checked before anything is sent, so a bad one never leaves a request behind.
  @spec timeout!(term()) :: :ok
  def timeout!(timeout) when is_nil(timeout) or timeout == :infinity, do: :ok
  def timeout!(timeout) when is_integer(timeout) and timeout >= 0 and timeout <= @max_timeout, do: :ok

  def timeout!(timeout),
    do:
      raise(
        ArgumentError,
        "a timeout is milliseconds (an integer in [0, #{@max_timeout}]) or :infinity, got #{inspect(timeout)}"
      )

  defp each!(key, list, ok?) do
    unless Enum.all?(list, ok?),
      do:
        raise(
          ArgumentError,
          "invalid value #{inspect(list)} for Sidecar option #{inspect(key)}: #{doc(key)}"
        )

    :ok
  end

  defp codec!(module) do
    Code.ensure_loaded(module)

    unless function_exported?(module, :encode, 1) and function_exported?(module, :decode, 1) do
      raise ArgumentError, "Sidecar option :codec: #{inspect(module)} does not implement Sidecar.Codec"
    end

    :ok
  end

  defp resolve_python!(python) do
    found = if String.contains?(python, "/"), do: python, else: System.find_executable(python)

    unless found && File.regular?(found) do
      raise ArgumentError, "Sidecar option :python: executable #{inspect(python)} not found"
    end

    # Port.open would raise :eacces from inside the connection's init, not a Sidecar.Error
    unless match?({:ok, %File.Stat{mode: mode}} when Bitwise.band(mode, 0o111) != 0, File.stat(found)) do
      raise ArgumentError, "Sidecar option :python: #{inspect(python)} is not executable"
    end

    Path.expand(found)
  end
end
