defmodule Sidecar.Msgpack do
  @moduledoc """
  A small msgpack codec, written to the protocol's needs (no hex dependency).

  Encoding: `nil`, booleans, integers (smallest encoding, as the spec requires), floats (as float64),
  binaries (as str), `%Sidecar.Msgpack.Bin{}` (as bin), other atoms (as str), lists and maps (keys in
  sorted order, so bytes are reproducible). Decoding: str -> binary, bin -> `%Sidecar.Msgpack.Bin{}`,
  float32/float64 -> float (NaN and the infinities, which the BEAM has no float for, -> `:nan`,
  `:infinity`, `:neg_infinity`); ext types are rejected.

  What msgpack cannot carry is refused, never sent as something else: an integer outside
  [-2^63, 2^64), a binary that is not UTF-8 (a str must be; send bytes as `%Sidecar.Msgpack.Bin{}`),
  a tuple, a pid..., and a list or map as a map key, which the sidecar cannot read. `encode/1` then
  returns `{:error, {:unsupported, value, why, path}}`, `path` the keys and list indexes from the top
  of the term down to the value.
  """

  @behaviour Sidecar.Codec

  defmodule Bin do
    @moduledoc "Raw bytes that travel as msgpack bin rather than str."
    defstruct data: <<>>
    @type t :: %__MODULE__{data: binary()}
  end

  @impl true
  @spec encode(term()) :: {:ok, iodata()} | {:error, {:unsupported, term(), String.t(), [term()]}}
  def encode(term) do
    {:ok, enc(term)}
  catch
    {:unsupported, value, why} -> {:error, {:unsupported, value, why, path_to(term, value) || []}}
  end

  @impl true
  @spec decode(binary()) :: {:ok, term()} | {:error, atom()}
  def decode(binary) when is_binary(binary) do
    case dec(binary) do
      {value, <<>>} -> {:ok, value}
      {_value, _rest} -> {:error, :trailing_bytes}
    end
  catch
    {:invalid, reason} -> {:error, reason}
  end

  @doc false
  # `body`, the msgpack of a map, with `pairs` added in front of its entries: how a request encoded by
  # its caller gets the id and op its connection gives it (and "id" comes first, readable at once).
  @spec prepend_entries(binary(), [{term(), term()}]) :: {:ok, iodata()} | :error
  def prepend_entries(body, pairs) do
    with {:ok, count, entries} <- map_entries(body) do
      {:ok, [map_header(count + length(pairs)), Enum.map(pairs, fn {k, v} -> [enc(k), enc(v)] end), entries]}
    end
  end

  defp map_entries(<<0b1000::4, n::4, entries::binary>>), do: {:ok, n, entries}
  defp map_entries(<<0xDE, n::16, entries::binary>>), do: {:ok, n, entries}
  defp map_entries(<<0xDF, n::32, entries::binary>>), do: {:ok, n, entries}
  defp map_entries(_), do: :error

  # ---- encoding -----------------------------------------------------------------------------

  defp enc(nil), do: <<0xC0>>
  defp enc(false), do: <<0xC2>>
  defp enc(true), do: <<0xC3>>
  defp enc(n) when is_integer(n) and n >= 0 and n < 128, do: <<n>>
  defp enc(n) when is_integer(n) and n >= -32 and n < 0, do: <<n::signed-8>>
  defp enc(n) when is_integer(n) and n >= 0 and n < 0x100, do: <<0xCC, n>>
  defp enc(n) when is_integer(n) and n >= 0 and n < 0x10000, do: <<0xCD, n::16>>
  defp enc(n) when is_integer(n) and n >= 0 and n < 0x100000000, do: <<0xCE, n::32>>
  defp enc(n) when is_integer(n) and n >= 0 and n < 0x10000000000000000, do: <<0xCF, n::64>>
  defp enc(n) when is_integer(n) and n < 0 and n >= -0x80, do: <<0xD0, n::signed-8>>
  defp enc(n) when is_integer(n) and n < 0 and n >= -0x8000, do: <<0xD1, n::signed-16>>
  defp enc(n) when is_integer(n) and n < 0 and n >= -0x80000000, do: <<0xD2, n::signed-32>>
  defp enc(n) when is_integer(n) and n < 0 and n >= -0x8000000000000000, do: <<0xD3, n::signed-64>>

  defp enc(n) when is_integer(n),
    do: throw({:unsupported, n, "an integer outside msgpack's range [-2^63, 2^64)"})

  defp enc(f) when is_float(f), do: <<0xCB, f::float-64>>
  defp enc(%Bin{data: data}) when is_binary(data), do: [bin_header(byte_size(data)), data]

  defp enc(s) when is_binary(s) do
    unless String.valid?(s),
      do: throw({:unsupported, s, "a binary that is not UTF-8 text (bytes travel as %Sidecar.Msgpack.Bin{})"})

    [str_header(byte_size(s)), s]
  end

  defp enc(a) when is_atom(a), do: enc(Atom.to_string(a))

  defp enc(list) when is_list(list) do
    count = proper_length(list) || throw({:unsupported, list, "an improper list"})
    [array_header(count) | Enum.map(list, &enc/1)]
  end

  defp enc(map) when is_map(map) and not is_struct(map) do
    entries = Enum.sort_by(map, fn {k, _} -> sort_key(k) end)
    [map_header(map_size(map)) | Enum.map(entries, fn {k, v} -> [key(k), enc(v)] end)]
  end

  defp enc(other), do: throw({:unsupported, other, "a value msgpack has no type for"})

  # msgpack carries a list or a map as a map key, but the sidecar cannot read one (a Python dict key must
  # be hashable): the whole frame would be unreadable, its id too, and the caller would wait in vain.
  defp key(key) when is_list(key) or (is_map(key) and not is_struct(key, Bin)),
    do: throw({:unsupported, key, "a list or map as a map key (keys are strings, numbers, booleans or nil)"})

  defp key(key), do: enc(key)

  # Where `value` sits in `term` (the first place, depth first), found only once encoding failed.
  defp path_to(term, value) when term === value, do: []

  defp path_to(map, value) when is_map(map) and not is_struct(map) do
    Enum.find_value(Enum.sort_by(map, fn {k, _} -> sort_key(k) end), fn {k, v} ->
      cond do
        path_to(k, value) -> ["(a key)"]
        path = path_to(v, value) -> [k | path]
        true -> nil
      end
    end)
  end

  defp path_to(list, value) when is_list(list) do
    list
    |> Enum.with_index()
    |> Enum.find_value(fn {v, i} -> if path = path_to(v, value), do: [i | path] end)
  end

  defp path_to(_, _), do: nil

  defp proper_length(list) do
    length(list)
  rescue
    ArgumentError -> nil
  end

  # Keys sort by their text (UTF-8 byte order is code point order, as in the Python side's sort).
  defp sort_key(key) when is_atom(key) and key not in [nil, true, false], do: Atom.to_string(key)
  defp sort_key(key), do: key

  defp str_header(n) when n < 32, do: <<0b101::3, n::5>>
  defp str_header(n) when n < 0x100, do: <<0xD9, n>>
  defp str_header(n) when n < 0x10000, do: <<0xDA, n::16>>
  defp str_header(n), do: <<0xDB, n::32>>

  defp bin_header(n) when n < 0x100, do: <<0xC4, n>>
  defp bin_header(n) when n < 0x10000, do: <<0xC5, n::16>>
  defp bin_header(n), do: <<0xC6, n::32>>

  defp array_header(n) when n < 16, do: <<0b1001::4, n::4>>
  defp array_header(n) when n < 0x10000, do: <<0xDC, n::16>>
  defp array_header(n), do: <<0xDD, n::32>>

  defp map_header(n) when n < 16, do: <<0b1000::4, n::4>>
  defp map_header(n) when n < 0x10000, do: <<0xDE, n::16>>
  defp map_header(n), do: <<0xDF, n::32>>

  # ---- decoding -----------------------------------------------------------------------------

  defp dec(<<0xC0, rest::binary>>), do: {nil, rest}
  defp dec(<<0xC2, rest::binary>>), do: {false, rest}
  defp dec(<<0xC3, rest::binary>>), do: {true, rest}
  defp dec(<<0::1, n::7, rest::binary>>), do: {n, rest}
  defp dec(<<0b111::3, n::5, rest::binary>>), do: {n - 32, rest}
  defp dec(<<0xCC, n, rest::binary>>), do: {n, rest}
  defp dec(<<0xCD, n::16, rest::binary>>), do: {n, rest}
  defp dec(<<0xCE, n::32, rest::binary>>), do: {n, rest}
  defp dec(<<0xCF, n::64, rest::binary>>), do: {n, rest}
  defp dec(<<0xD0, n::signed-8, rest::binary>>), do: {n, rest}
  defp dec(<<0xD1, n::signed-16, rest::binary>>), do: {n, rest}
  defp dec(<<0xD2, n::signed-32, rest::binary>>), do: {n, rest}
  defp dec(<<0xD3, n::signed-64, rest::binary>>), do: {n, rest}
  defp dec(<<0xCA, f::float-32, rest::binary>>), do: {f, rest}
  defp dec(<<0xCB, f::float-64, rest::binary>>), do: {f, rest}
  defp dec(<<0xCA, sign::1, 255::8, fraction::23, rest::binary>>), do: {non_finite(sign, fraction), rest}
  defp dec(<<0xCB, sign::1, 2047::11, fraction::52, rest::binary>>), do: {non_finite(sign, fraction), rest}
  defp dec(<<0b101::3, n::5, rest::binary>>), do: take(rest, n, :str)
  defp dec(<<0xD9, n, rest::binary>>), do: take(rest, n, :str)
  defp dec(<<0xDA, n::16, rest::binary>>), do: take(rest, n, :str)
  defp dec(<<0xDB, n::32, rest::binary>>), do: take(rest, n, :str)
  defp dec(<<0xC4, n, rest::binary>>), do: take(rest, n, :bin)
  defp dec(<<0xC5, n::16, rest::binary>>), do: take(rest, n, :bin)
  defp dec(<<0xC6, n::32, rest::binary>>), do: take(rest, n, :bin)
  defp dec(<<0b1001::4, n::4, rest::binary>>), do: array(rest, n, [])
  defp dec(<<0xDC, n::16, rest::binary>>), do: array(rest, n, [])
  defp dec(<<0xDD, n::32, rest::binary>>), do: array(rest, n, [])
  defp dec(<<0b1000::4, n::4, rest::binary>>), do: map(rest, n, [])
  defp dec(<<0xDE, n::16, rest::binary>>), do: map(rest, n, [])
  defp dec(<<0xDF, n::32, rest::binary>>), do: map(rest, n, [])
  defp dec(<<>>), do: throw({:invalid, :truncated})

  defp dec(<<byte, _::binary>>) when byte in [0xC1, 0xC7, 0xC8, 0xC9] or byte in 0xD4..0xD8,
    do: throw({:invalid, :unsupported_type})

  defp dec(_), do: throw({:invalid, :truncated})

  # The BEAM has no NaN or infinity: a reply that carries one (a log-probability of -inf, the only one
  # the protocol sends) keeps its place as an atom, so that its request still gets it.
  defp non_finite(_sign, fraction) when fraction != 0, do: :nan
  defp non_finite(0, 0), do: :infinity
  defp non_finite(1, 0), do: :neg_infinity

  defp take(binary, n, kind) do
    case binary do
      <<data::binary-size(n), rest::binary>> when kind == :bin -> {%Bin{data: data}, rest}
      <<data::binary-size(n), rest::binary>> -> {data, rest}
      _ -> throw({:invalid, :truncated})
    end
  end

  defp array(rest, 0, acc), do: {Enum.reverse(acc), rest}

  defp array(binary, n, acc) do
    {value, rest} = dec(binary)
    array(rest, n - 1, [value | acc])
  end

  defp map(rest, 0, acc), do: {Map.new(acc), rest}

  defp map(binary, n, acc) do
    {key, rest} = dec(binary)
    {value, rest} = dec(rest)
    map(rest, n - 1, [{key, value} | acc])
  end
end
