defmodule Sidecar.Protocol do
  @moduledoc """
  Builds requests and classifies incoming messages, with no process and no I/O. Framing is the
  Port's job (`{:packet, 4}`); the codec turns maps into payloads and back.
  """

  @type message ::
          {:event, non_neg_integer(), map()}
          | {:reply, non_neg_integer(), {:ok, map()} | {:error, map()}}
          | {:unattributed, map()}
          | {:invalid, term()}

  @spec request(non_neg_integer(), String.t(), map()) :: map()
  def request(id, op, params), do: Map.merge(params, %{"id" => id, "op" => op})

  @spec classify(term()) :: message()
  def classify(%{"id" => id, "event" => _} = event) when is_integer(id), do: {:event, id, event}

  def classify(%{"id" => id, "ok" => true, "result" => result}) when is_integer(id),
    do: {:reply, id, {:ok, result}}

  def classify(%{"id" => id, "ok" => false, "error" => error}) when is_integer(id),
    do: {:reply, id, {:error, error}}

  def classify(%{"id" => nil, "ok" => false, "error" => error}), do: {:unattributed, error}
  def classify(other), do: {:invalid, other}
end
