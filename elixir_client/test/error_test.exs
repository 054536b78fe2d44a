defmodule Sidecar.ErrorTest do
  use ExUnit.Case, async: true

  import Sidecar.Test.Helpers
  alias Sidecar.Error

  test "every error code in the protocol's conformance vectors is a reason of its own" do
    codes = vectors("conformance.json") |> error_codes() |> Enum.uniq()
    assert "limit_exceeded" in codes

    for code <- codes do
      assert Error.from_reply(%{"code" => code, "message" => "m"}).reason == String.to_atom(code)
    end
  end

  test "the newer codes are known, limit_exceeded keeps its details, an unknown code is :unknown" do
    for code <- ~w(limit_exceeded invalid_model forbidden invalid_logits frame_too_large cache_budget_exceeded
                   unknown_device invalid_session_file) do
      assert Error.from_reply(%{"code" => code, "message" => "m"}).reason == String.to_atom(code)
    end

    reply = %{
      "code" => "limit_exceeded",
      "message" => "m",
      "limit" => "max_prompt_bytes",
      "max" => 8,
      "value" => 9
    }

    assert %Error{
             reason: :limit_exceeded,
             details: %{"limit" => "max_prompt_bytes", "max" => 8, "value" => 9}
           } = Error.from_reply(reply)

    assert %Error{reason: :unknown} = Error.from_reply(%{"code" => "from_the_future", "message" => "m"})
  end

  test "an error that breaks the protocol is still an error of its request, never a crash" do
    assert %Error{reason: :internal, message: "the sidecar's error carried no message (code \"internal\")"} =
             Error.from_reply(%{"code" => "internal"})

    assert %Error{reason: :unknown, details: %{"x" => 1}} = Error.from_reply(%{"message" => 5, "x" => 1})

    assert %Error{reason: :unknown, message: "the sidecar's error is not a map: [1, 2]"} =
             Error.from_reply([1, 2])
  end

  defp error_codes(%{"error" => %{"code" => code}} = map), do: [code | error_codes(Map.delete(map, "error"))]
  defp error_codes(%{} = map), do: Enum.flat_map(Map.values(map), &error_codes/1)
  defp error_codes(list) when is_list(list), do: Enum.flat_map(list, &error_codes/1)
  defp error_codes(_), do: []
end
