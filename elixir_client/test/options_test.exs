defmodule Sidecar.OptionsTest do
  use ExUnit.Case, async: true

  test "start options are validated before anything starts" do
    assert_raise ArgumentError, ~r/unknown Sidecar start option :modle; valid options: :python, :model/, fn ->
      Sidecar.start_link(modle: "x")
    end

    assert_raise ArgumentError, ~r/invalid value -1 for Sidecar option :call_timeout/, fn ->
      Sidecar.start_link(call_timeout: -1)
    end

    # past what `receive ... after` takes: accepted before, then every call raised ErlangError :timeout_value
    for key <- [:call_timeout, :startup_timeout] do
      assert_raise ArgumentError, ~r/invalid value 4294967296 for Sidecar option #{inspect(key)}/, fn ->
        Sidecar.start_link([{key, 4_294_967_296}])
      end
    end

    assert_raise ArgumentError, ~r/option :python: executable "no-such-python" not found/, fn ->
      Sidecar.start_link(python: "no-such-python")
    end

    # a file that is there but not executable: Port.open raised :eacces inside the connection's init
    script = Path.join(System.tmp_dir!(), "not-executable-#{System.unique_integer([:positive])}")
    File.write!(script, "#!/bin/sh\n")
    File.chmod!(script, 0o644)

    assert_raise ArgumentError, ~r/option :python: ".*not-executable-\d+" is not executable/, fn ->
      Sidecar.start_link(python: script, log_stderr: false)
    end

    File.rm!(script)

    assert_raise ArgumentError, ~r/does not implement Sidecar.Codec/, fn ->
      Sidecar.start_link(codec: String)
    end

    assert_raise ArgumentError, ~r/option :env/, fn -> Sidecar.start_link(env: [{"A", 1}]) end

    assert_raise ArgumentError, ~r/invalid value 7 for Sidecar option :device/, fn ->
      Sidecar.start_link(device: 7)
    end

    # the sidecar exits at start for it (a :sidecar_exited start error)
    assert_raise ArgumentError,
                 ~r/:dtype is the dtype of the model: loaded at start; with model: nil there is none/,
                 fn ->
                   Sidecar.start_link(model: nil, dtype: :bf16)
                 end

    # a map: a FunctionClauseError in the validation itself before
    assert_raise ArgumentError, ~r/start options must be a keyword list, got %{model: :default}/, fn ->
      Sidecar.start(%{model: :default})
    end

    # a :via module with no registry functions: GenServer's UndefinedFunctionError before
    for bad <- [{:via, :no_such_registry, :x}, {:via, String, :x}, {:via, "Registry", :x}, {:global, :x, :y}] do
      assert_raise ArgumentError, ~r/for Sidecar option :name/, fn -> Sidecar.start(name: bad) end
    end
  end

  test ":device, :dtype and :session_dir become the sidecar's --device, --dtype and --session-dir flags" do
    assert Sidecar.Options.flags(device: "cuda:1", dtype: :bf16) == ["--device", "cuda:1", "--dtype", "bf16"]
    assert Sidecar.Options.flags(session_dir: "/var/sessions") == ["--session-dir", "/var/sessions"]
    assert Sidecar.Options.flags(device: nil, dtype: nil, session_dir: nil) == []
    assert Sidecar.Options.flags(share_prefixes: false) == ["--no-share-prefixes"]
    assert Sidecar.Options.flags(share_prefixes: true) == []

    assert_raise ArgumentError, ~r/invalid value "" for Sidecar option :session_dir/, fn ->
      Sidecar.start_link(session_dir: "")
    end
  end

  test "every flag an option becomes is one the sidecar's command line knows, and its doc names it" do
    opts = Sidecar.Test.Helpers.sidecar_opts()
    {help, 0} = System.cmd(opts[:python], ["-m", "sidecar", "--help"], cd: opts[:cd], stderr_to_stdout: true)

    flagged =
      for {key, definition} <- Sidecar.Options.definitions(), definition[:flag] != nil, do: {key, definition}

    assert length(flagged) == 4

    for {key, definition} <- flagged do
      flag = with {:when_false, name} <- definition[:flag], do: name
      assert help =~ ~r/\s#{Regex.escape(flag)}[\s,\]]/, "#{flag} (option #{inspect(key)}) is not in --help"
      assert Sidecar.Options.doc(key) =~ flag
    end
  end

  test "child_spec uses the name as id" do
    assert %{id: MyApp.Sidecar, start: {Sidecar, :start_link, [[name: MyApp.Sidecar]]}} =
             Sidecar.child_spec(name: MyApp.Sidecar)
  end
end
