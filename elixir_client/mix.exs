defmodule Sidecar.MixProject do
  use Mix.Project

  def project do
    [
      app: :sidecar,
      version: "0.1.0",
      elixir: "~> 1.14",
      start_permanent: Mix.env() == :prod,
      elixirc_paths: elixirc_paths(Mix.env()),
      # No dependencies on purpose: nothing from hex is needed to talk to the sidecar.
      deps: []
    ]
  end

  def application do
    [extra_applications: [:logger]]
  end

  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]
end
