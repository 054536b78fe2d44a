defmodule Sidecar.Codec do
  @moduledoc """
  The payload codec behaviour. `Sidecar.Msgpack` is the built-in implementation; an application that
  already depends on Msgpax can plug it in with a five-line module and the `:codec` start option:

      defmodule MyApp.MsgpaxCodec do
        @behaviour Sidecar.Codec
        def encode(term), do: Msgpax.pack(term)
        def decode(binary), do: Msgpax.unpack(binary, binary: true)
      end

  Text travels as msgpack str and raw bytes as bin: an encoder must write Elixir binaries as str and
  `%Sidecar.Msgpack.Bin{}` as bin.
  """

  @callback encode(term()) :: {:ok, iodata()} | {:error, term()}
  @callback decode(binary()) :: {:ok, term()} | {:error, term()}
end
