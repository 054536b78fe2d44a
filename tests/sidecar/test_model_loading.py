"""Loading safety: broken or hostile model directories get typed errors through `Engine.load` and through
the server's `load_model`, nothing shipped in a directory runs without consent, `load_model` stays inside
the model roots, and nothing reaches for the network.
"""

import itertools
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from protocol.peer import Peer
from sidecar import Engine
from sidecar.errors import InvalidArgument, SidecarError

FAST_S = 5.0  # refusing remote code needs no download and no weights: anything slower is waiting on something
LLAMA = "LlamaForCausalLM"


def copy_model(default_dir, target, *, weights=True):
    target.mkdir(parents=True)
    for source in default_dir.iterdir():
        if weights or source.suffix != ".safetensors":
            shutil.copy(source, target / source.name)
    return target


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


class Evil:
    """Unpickling this runs a shell command: what a hostile pytorch_model.bin does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


# Each builder fills an empty directory `d`, given the default model and a directory for markers.

def no_weights(default, d, markers):
    copy_model(default, d, weights=False)


def config_not_json(default, d, markers):
    copy_model(default, d)
    (d / "config.json").write_text('{"model_type": "llama",')


def config_a_list(default, d, markers):
    copy_model(default, d)
    (d / "config.json").write_text("[1, 2, 3]")


def truncated_safetensors(default, d, markers):
    copy_model(default, d)
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])


def config_of_another_architecture(default, d, markers):
    """Llama weights under a GPT-2 config: transformers would initialise every GPT-2 parameter at random."""
    copy_model(default, d)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2,
                                               "n_embd": 64, "n_head": 2, "vocab_size": 1024, "n_positions": 256}))


def malicious_pickle(default, d, markers):
    copy_model(default, d, weights=False)
    torch.save({"model.embed_tokens.weight": Evil(markers / "pickle-ran")}, d / "pytorch_model.bin")


def auto_map_local(default, d, markers):
    """A model type transformers does not know, whose code the directory ships (and does not, here)."""
    copy_model(default, d)
    edit_json(d / "config.json", model_type="x_llama", auto_map={"AutoModelForCausalLM": "modeling_x.XModel"})


def auto_map_module_missing(default, d, markers):
    """Code for a type transformers knows, named by auto_map but not shipped: trusted, there is none to run."""
    copy_model(default, d)
    edit_json(d / "config.json", auto_map={"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"})


def generation_config_a_list(default, d, markers):
    copy_model(default, d)
    (d / "generation_config.json").write_text("[2]")


def generation_config_truncated(default, d, markers):
    """transformers passes over it: the model sampled greedy where its file said do_sample (helper-86)."""
    copy_model(default, d)
    (d / "generation_config.json").write_text('{"do_sample": tru')


def auto_map_other_repo(default, d, markers):
    copy_model(default, d)
    edit_json(d / "config.json", auto_map={"AutoModelForCausalLM": "someone/repo--modeling_x.Model"})


def tokenizer_auto_map_other_repo(default, d, markers):
    copy_model(default, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["tokenizer_class"]
    config["auto_map"] = {"AutoTokenizer": ["someone/repo--tokenization_x.XTok", "someone/repo--tokenization_x.XTokFast"]}
    (d / "tokenizer_config.json").write_text(json.dumps(config))


def auto_map_outside_path(default, d, markers):
    """auto_map naming a module by a path outside the directory; importing it would leave a marker."""
    copy_model(default, d)
    outside = d.parent.parent / f"{d.parent.name}-code"
    outside.mkdir(exist_ok=True)
    (outside / "evil.py").write_text(f"import pathlib\npathlib.Path({str(markers / 'outside-code-ran')!r}).touch()\n")
    edit_json(d / "config.json", auto_map={"AutoConfig": f"{outside}/evil.MyConfig"})


def remote_code_model(default, d, letter: str, config_body: str, head: str = ""):
    """A copy of the default model whose config class (`<letter>Config`, `head` before it, `config_body` its
    body) and model class ship in the directory, as `configuration_<letter>.py` and `modeling_<letter>.py`."""
    copy_model(default, d)
    upper = letter.upper()
    (d / f"configuration_{letter}.py").write_text(
        f"{head}from transformers import LlamaConfig\n\n\nclass {upper}Config(LlamaConfig):\n"
        f"    model_type = '{letter}_llama'\n{config_body}")
    (d / f"modeling_{letter}.py").write_text(
        f"from transformers import LlamaForCausalLM\n\nfrom .configuration_{letter} import {upper}Config\n\n\n"
        f"class {upper}Model(LlamaForCausalLM):\n    config_class = {upper}Config\n")
    edit_json(d / "config.json", model_type=f"{letter}_llama", auto_map={
        "AutoConfig": f"configuration_{letter}.{upper}Config", "AutoModelForCausalLM": f"modeling_{letter}.{upper}Model"})


def shipped_code(default, d, markers):
    """A model whose configuration module leaves a marker when imported: a working remote-code model."""
    remote_code_model(default, d, "x", "", head=f"import pathlib\npathlib.Path({str(markers / d.name)!r}).touch()\n")


def waits_for_a_file(default, d, markers):
    """A working remote-code model whose config, once read, waits until `d/released` exists (2 minutes at
    most): a load that lasts as long as a test wants, outside transformers' building of the modules."""
    remote_code_model(default, d, "w", (
        "\n    def __init__(self, **kwargs):\n        super().__init__(**kwargs)\n"
        "        deadline = time.monotonic() + 120\n"
        f"        while not pathlib.Path({str(d / 'released')!r}).exists() and time.monotonic() < deadline:\n"
        "            time.sleep(0.01)\n"), head="import pathlib\nimport time\n")


def end_token_not_an_id(default, d, markers):
    copy_model(default, d)
    edit_json(d / "generation_config.json", eos_token_id=[2, None])


BROKEN = [  # (kind, builder, trust_remote_code, code)
    ("config.json but no weights", no_weights, False, "invalid_model"),
    ("config.json not JSON", config_not_json, False, "invalid_model"),
    ("config.json a JSON list", config_a_list, False, "invalid_model"),
    ("truncated safetensors", truncated_safetensors, False, "invalid_model"),
    ("weights of another architecture than the config's", config_of_another_architecture, False, "invalid_model"),
    ("an end token in generation_config.json that is no token id", end_token_not_an_id, False, "invalid_model"),
    ("generation_config.json a JSON list", generation_config_a_list, False, "invalid_model"),
    ("generation_config.json truncated", generation_config_truncated, False, "invalid_model"),
    ("malicious pickle as pytorch_model.bin", malicious_pickle, False, "invalid_model"),
    ("auto_map without trust", auto_map_local, False, "remote_code_required"),
    ("auto_map naming another repository, trusted", auto_map_other_repo, True, "invalid_model"),
    ("tokenizer auto_map naming another repository, trusted", tokenizer_auto_map_other_repo, True, "invalid_model"),
    ("auto_map naming a module outside the directory by path, trusted", auto_map_outside_path, True, "invalid_model"),
    ("auto_map naming a module the directory lacks, trusted", auto_map_module_missing, True, "invalid_model"),
]
IDS = [getattr(row, "id", None) or row[0] for row in BROKEN]
BUILDERS = [no_weights, config_not_json, config_a_list, truncated_safetensors, config_of_another_architecture,
            end_token_not_an_id, generation_config_a_list, generation_config_truncated, malicious_pickle, auto_map_local,
            auto_map_module_missing, auto_map_other_repo, tokenizer_auto_map_other_repo, auto_map_outside_path, shipped_code, waits_for_a_file]
SERVER = [sys.executable, "-m", "sidecar", "--log-level", "WARNING", "--max-models", "16"]


@pytest.fixture(scope="module")
def dirs(default_dir, tmp_path_factory):
    """The model root with one directory per builder, a copy of the default model outside it, and markers."""
    root = tmp_path_factory.mktemp("root")
    markers = tmp_path_factory.mktemp("markers")
    for build in BUILDERS:
        build(default_dir, root / build.__name__, markers)
    copy_model(default_dir, root / "good")
    (root / "escape").symlink_to(default_dir, target_is_directory=True)
    outside = copy_model(default_dir, tmp_path_factory.mktemp("outside") / "model")
    return {"root": root, "markers": markers, "outside": outside, "default": default_dir,
            "modules": tmp_path_factory.mktemp("hf-modules")}


@pytest.fixture(scope="module")
def servers(dirs):
    """`plain`: the outside copy as --model, no remote code. `trusted`: --trust-remote-code, no startup model."""
    # remote code is copied into HF_MODULES_CACHE; one thread, because a thread team is slow on a busy machine
    env = {**os.environ, "HF_MODULES_CACHE": str(dirs["modules"]), "OMP_NUM_THREADS": "1"}
    roots = ["--model-root", str(dirs["root"])]
    with Peer(SERVER + roots + ["--model", str(dirs["outside"])], env=env, stderr=subprocess.DEVNULL) as plain, \
            Peer(SERVER + roots + ["--trust-remote-code"], env=env, stderr=subprocess.DEVNULL) as trusted:
        yield {"plain": plain, "trusted": trusted}


NAMES = (f"m{i}" for i in itertools.count())


def load_model(peer, path, **params):
    return peer.call("load_model", name=next(NAMES), path=path if path is None else str(path), **params)


@pytest.fixture
def no_network(monkeypatch):
    """Records (and refuses) every attempt of this process to resolve a host name or open a network connection."""
    attempts = []

    def refuse(self, address, *args):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise OSError(f"the test refuses network access (to {address})")
        return connect(self, address, *args)

    def refuse_lookup(host, *args, **kwargs):
        attempts.append(host)
        raise socket.gaierror(f"the test refuses network access (looking up {host})")

    connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse_lookup)
    return attempts


@pytest.mark.parametrize("kind, build, trust, code", BROKEN, ids=IDS)
def test_engine_load(dirs, no_network, kind, build, trust, code):
    started = time.monotonic()
    with pytest.raises(SidecarError) as caught:
        Engine.load(dirs["root"] / build.__name__, trust_remote_code=trust)
    assert (caught.value.code, no_network) == (code, []), caught.value
    assert caught.value.details.get("path") == str(dirs["root"] / build.__name__), caught.value.details
    assert not trust or time.monotonic() - started < FAST_S
    assert not list(dirs["markers"].iterdir())


@pytest.mark.parametrize("kind, build, trust, code", BROKEN, ids=IDS)
def test_load_model(dirs, servers, kind, build, trust, code):
    started = time.monotonic()
    peer = servers["trusted" if trust else "plain"]
    reply = load_model(peer, dirs["root"] / build.__name__, trust_remote_code=trust)
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    assert not trust or time.monotonic() - started < FAST_S
    assert not list(dirs["markers"].iterdir())
    assert peer.call("ping")["ok"]


def test_shipped_code_runs_only_with_consent_from_both_sides(dirs, servers):
    path, marker = dirs["root"] / "shipped_code", dirs["markers"] / "shipped_code"
    with pytest.raises(SidecarError) as caught:
        Engine.load(path)
    assert caught.value.code == "remote_code_required"
    refused = load_model(servers["plain"], path, trust_remote_code=True)
    assert refused["error"]["code"] == "forbidden" and refused["error"]["param"] == "trust_remote_code", refused
    assert load_model(servers["plain"], path)["error"]["code"] == "remote_code_required"
    assert load_model(servers["trusted"], path)["error"]["code"] == "remote_code_required"
    assert not marker.exists()
    # the marker works: with consent from the operator and the client, the code is imported and loads
    loaded = load_model(servers["trusted"], path, trust_remote_code=True)
    assert loaded["ok"] and loaded["result"]["architecture"] == "XModel", loaded
    assert marker.exists()
    assert servers["trusted"].call("unload_model", model=loaded["result"]["name"])["ok"]


def test_streams_go_on_while_a_model_loads_and_the_frames_after_it_wait(dirs, servers):
    """A generation on one model streams to its end while another model loads; a ping sent after the
    load_model is answered after it (PROTOCOL.md, section 4)."""
    peer, path = servers["trusted"], dirs["root"] / "waits_for_a_file"
    release = threading.Timer(60, (path / "released").touch)  # with a load that stops the loop, the test ends
    release.start()
    try:
        streaming = load_model(peer, dirs["root"] / "good")["result"]["name"]
        session = peer.call("open_session", model=streaming)["result"]["session"]
        peer.send({"id": 901, "op": "generate", "session": session, "token_ids": [5, 6], "max_new_tokens": 40,
                   "eos_token_ids": [], "stream": True})
        assert peer.next_for(901)["event"] == "token"
        peer.send({"id": 902, "op": "load_model", "name": "waiting", "path": str(path), "trust_remote_code": True})
        peer.send({"id": 903, "op": "ping"})
        events, done = peer.reply_for(901)
        assert done["ok"] and len(events) == 39 and 902 not in peer.replied and 903 not in peer.replied, peer.replied
        (path / "released").touch()
        loaded = peer.next_for(902)
        assert loaded["ok"] and loaded["result"]["architecture"] == "WModel", loaded
        assert peer.next_for(903)["ok"] and peer.replied[-2:] == [902, 903]
    finally:
        release.cancel()
        (path / "released").touch()
    for name in ("waiting", streaming):
        assert peer.call("unload_model", model=name)["ok"]


def test_end_of_input_during_a_load_that_does_not_end_exits_at_once(dirs, tmp_path):
    """The client is gone (PROTOCOL.md, section 1): the server exits 0 without waiting for a load that
    model code holds up, which a join of the loading thread, or a non-daemon one, would wait for."""
    env = {**os.environ, "HF_MODULES_CACHE": str(dirs["modules"]), "OMP_NUM_THREADS": "1"}
    path = tmp_path / "waits"  # of its own: another test releases the module's
    waits_for_a_file(dirs["default"], path, dirs["markers"])
    with Peer(SERVER + ["--model-root", str(tmp_path), "--trust-remote-code"], env=env,
              stderr=subprocess.DEVNULL) as peer:
        assert peer.call("ping")["ok"]
        peer.send({"id": 5, "op": "load_model", "name": "waiting", "path": str(path), "trust_remote_code": True})
        time.sleep(1)  # into the load: the config's wait
        assert peer.process.poll() is None and not (path / "released").exists()
        assert peer.close(timeout=20) == 0
        assert not (path / "released").exists()  # it never ended


def test_a_directory_inside_the_root_loads(dirs, servers):
    plain = servers["plain"]
    loaded = load_model(plain, dirs["root"] / "good")
    assert loaded["ok"] and loaded["result"]["architecture"] == LLAMA, loaded
    name = loaded["result"]["name"]
    session = plain.call("open_session", model=name)["result"]["session"]
    assert plain.call("generate", session=session, prompt="hi", max_new_tokens=2, eos_token_ids=[])["ok"]
    assert plain.call("unload_model", model=name)["ok"]


@pytest.mark.parametrize("where", ["outside", "parent of the --model directory", "traversal", "symlink"])
def test_paths_outside_the_roots_are_forbidden(dirs, servers, where):
    root = dirs["root"]
    path = {
        "outside": dirs["default"],
        "parent of the --model directory": dirs["outside"].parent,
        "traversal": f"{root}/{os.path.relpath(dirs['default'], root)}",
        "symlink": root / "escape",
    }[where]
    for server in ("plain", "trusted"):
        reply = load_model(servers[server], path)
        assert reply["ok"] is False, reply
        assert (reply["error"]["code"], reply["error"]["param"]) == ("forbidden", "path"), reply


def test_the_startup_model_and_the_embedded_one_are_always_allowed(dirs, servers):
    again = load_model(servers["plain"], dirs["outside"])
    assert again["ok"] and again["result"]["path"] == str(dirs["outside"]), again
    for server in ("plain", "trusted"):
        embedded = load_model(servers[server], None)
        assert embedded["ok"] and embedded["result"]["architecture"] == LLAMA, embedded
        assert servers[server].call("unload_model", model=embedded["result"]["name"])["ok"]
    assert servers["plain"].call("unload_model", model=again["result"]["name"])["ok"]
    # the trusted server was started without --model: the outside copy is not its to load
    assert load_model(servers["trusted"], dirs["outside"])["error"]["code"] == "forbidden"


@pytest.mark.parametrize("kind", ["NUL byte", "loop of symbolic links", "name longer than the system takes"])
def test_an_unusable_path_is_a_typed_error(dirs, servers, kind):
    """The server answers `invalid_argument` for a path it cannot even resolve, `model_not_found` for one that
    names nothing; the Python API `model_not_found` for all. Never `internal` (a loop made Path.resolve raise
    RuntimeError, and a name over 255 bytes made is_dir raise OSError)."""
    root = dirs["root"]
    if not (root / "loop_a").is_symlink():
        (root / "loop_a").symlink_to(root / "loop_b")
        (root / "loop_b").symlink_to(root / "loop_a")
    paths, server_code = {
        "NUL byte": ([f"{root}/good\0", f"{dirs['default']}\0"], "invalid_argument"),
        "loop of symbolic links": ([root / "loop_a", root / "loop_a" / "model"], "invalid_argument"),
        "name longer than the system takes": ([root / ("a" * 300), root / "good" / ("b" * 256)], "model_not_found"),
    }[kind]
    for path in paths:
        with pytest.raises(SidecarError) as caught:
            Engine.load(path)
        assert caught.value.code == "model_not_found"
        reply = load_model(servers["plain"], path)
        assert reply["error"]["code"] == server_code, reply
        if server_code == "invalid_argument":
            assert reply["error"]["option"] == "path", reply
        else:
            assert reply["error"]["message"].startswith("File name too long: no model directory"), reply
    for peer in servers.values():
        assert peer.call("stats")["result"]["in_flight"] == 0


def test_an_empty_name_or_path_is_invalid_argument(dirs, servers):
    """Sessions refuse an empty name, and so do models; an empty path would be the working directory (Path("")),
    which a client's unset variable should not load, even when that directory is a model inside the roots."""
    plain = servers["plain"]
    for params, option in (({"name": "", "path": None}, "name"), ({"name": "empty", "path": ""}, "path")):
        reply = plain.call("load_model", **params)
        assert (reply["error"]["code"], reply["error"]["option"]) == ("invalid_argument", option), reply
    names = [info["name"] for info in plain.call("models")["result"]["models"]]
    assert "" not in names and "empty" not in names, names
    cwd_server = SERVER + ["--model-root", str(dirs["root"] / "good")]
    with Peer(cwd_server, cwd=dirs["root"] / "good", stderr=subprocess.DEVNULL) as inside:
        reply = inside.call("load_model", name="here", path="")
        assert (reply["error"]["code"], reply["error"]["option"]) == ("invalid_argument", "path"), reply
        assert inside.call("load_model", name="here", path=".")["ok"]  # what "" would have loaded


def without_offline_settings():
    return {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}


def test_the_cli_process_is_offline():
    code = "import sidecar.__main__, huggingface_hub.constants as c; print(c.HF_HUB_OFFLINE)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=without_offline_settings())
    assert done.stdout.strip() == "True", done.stderr


def test_importing_the_library_imports_no_transformers():
    code = "import sys, sidecar; print(sorted(m for m in ('transformers', 'huggingface_hub') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=without_offline_settings())
    assert done.stdout.strip() == "[]", done.stderr


@pytest.mark.parametrize("option, value", [("prefill_chunk", 0), ("cache_budget_bytes", -1), ("max_rows", 0),
                                           ("share_prefixes", "yes")])
def test_an_engine_option_of_a_bad_value_is_refused_before_the_model_is_read(tmp_path, option, value):
    """`Engine.load` checked its options' names first, their values only once the model had loaded (seconds of
    reading weights for a `prefill_chunk` of 0): a directory that holds no model is not even looked at."""
    with pytest.raises(InvalidArgument) as caught:
        Engine.load(tmp_path / "no model here", **{option: value})
    assert caught.value.details == {"option": option}
