"""`python -m sidecar` at startup: every problem is one line on stderr and a non-zero status, never a traceback."""

import json
import shutil
import subprocess
import sys

import pytest

from sidecar import __version__


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def config_only(path, default_dir):
    shutil.copy(default_dir / "config.json", path / "config.json")


def malformed_config(path, default_dir):
    (path / "config.json").write_text("{")


def no_tokenizer(path, default_dir):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(default_dir / name, path / name)


def not_a_causal_lm(path, default_dir):
    (path / "config.json").write_text(json.dumps({"model_type": "t5"}))


@pytest.mark.parametrize("build, code", [
    (config_only, "no_tokenizer"), (malformed_config, "invalid_model"), (no_tokenizer, "no_tokenizer"),
    (not_a_causal_lm, "not_causal_lm"),
])
def test_a_model_that_cannot_load_is_one_line_and_status_2(tmp_path, default_dir, build, code):
    build(tmp_path, default_dir)
    done = run("--model", str(tmp_path), "--log-level", "WARNING")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"({code})" in lines[0] and str(tmp_path) in lines[0]


@pytest.mark.parametrize("args, says", [
    (["--log-level", "LOUD"], "invalid choice: 'LOUD'"),
    (["--model", "/nonexistent/model"], "(model_not_found)"),
    (["--max-sessions", "0"], "limit max_sessions must be an integer >= 1"),
    (["--fds", "3"], "--fds takes two descriptors"),
    (["--model", "default", "--chat-template", "/nonexistent.jinja"], "cannot read --chat-template"),
])
def test_bad_options_are_one_clear_line(default_dir, args, says):
    done = run(*args)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr


def test_version():
    done = run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"python -m sidecar {__version__} (protocol 1)"
