defmodule Sidecar.Test.JSON do
  @moduledoc false
  # A minimal JSON decoder for reading the protocol's golden vectors in tests (no hex dependencies,
  # and Elixir 1.14 has no JSON module). Objects become maps, numbers integers or floats.

  def decode!(text) do
    {value, rest} = value(skip(text))
    "" = skip(rest)
    value
  end

  defp skip(<<c, rest::binary>>) when c in ~c" \t\n\r", do: skip(rest)
  defp skip(rest), do: rest

  defp value("{" <> rest), do: object(skip(rest), %{})
  defp value("[" <> rest), do: array(skip(rest), [])
  defp value("\"" <> rest), do: string(rest, [])
  defp value("true" <> rest), do: {true, rest}
  defp value("false" <> rest), do: {false, rest}
  defp value("null" <> rest), do: {nil, rest}
  defp value(rest), do: number(rest)

  defp object("}" <> rest, acc), do: {acc, rest}

  defp object("\"" <> rest, acc) do
    {key, rest} = string(rest, [])
    ":" <> rest = skip(rest)
    {val, rest} = value(skip(rest))

    case skip(rest) do
      "," <> rest -> object(skip(rest), Map.put(acc, key, val))
      "}" <> rest -> {Map.put(acc, key, val), rest}
    end
  end

  defp array("]" <> rest, acc), do: {Enum.reverse(acc), rest}

  defp array(text, acc) do
    {val, rest} = value(text)

    case skip(rest) do
      "," <> rest -> array(skip(rest), [val | acc])
      "]" <> rest -> {Enum.reverse([val | acc]), rest}
    end
  end

  defp string("\"" <> rest, acc), do: {IO.iodata_to_binary(Enum.reverse(acc)), rest}

  defp string("\\u" <> <<hex::binary-4, rest::binary>>, acc) do
    code = String.to_integer(hex, 16)

    if code in 0xD800..0xDBFF do
      "\\u" <> <<low::binary-4, rest::binary>> = rest
      low = String.to_integer(low, 16)
      string(rest, [<<0x10000 + (code - 0xD800) * 0x400 + (low - 0xDC00)::utf8>> | acc])
    else
      string(rest, [<<code::utf8>> | acc])
    end
  end

  defp string("\\" <> <<c, rest::binary>>, acc) do
    char =
      %{?" => "\"", ?\\ => "\\", ?/ => "/", ?b => "\b", ?f => "\f", ?n => "\n", ?r => "\r", ?t => "\t"}[c]

    string(rest, [char | acc])
  end

  defp string(<<c::utf8, rest::binary>>, acc), do: string(rest, [<<c::utf8>> | acc])

  defp number(text) do
    [token | _] = Regex.run(~r/^-?\d+(\.\d+)?([eE][+-]?\d+)?/, text)
    rest = binary_part(text, byte_size(token), byte_size(text) - byte_size(token))

    if String.contains?(token, [".", "e", "E"]) do
      {elem(Float.parse(token), 0), rest}
    else
      {String.to_integer(token), rest}
    end
  end
end
