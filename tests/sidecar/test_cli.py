"""`python -m sidecar` at startup: every problem is one line on stderr and a non-zero status, never a traceback."""

import json
import os
import resource
import shutil
import signal
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


def weights_of_another_architecture(path, default_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(default_dir / name, path / name)
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
                                                  "vocab_size": 1024}))


@pytest.mark.parametrize("build, code, level", [
    (config_only, "no_tokenizer", "WARNING"), (malformed_config, "invalid_model", "WARNING"),
    (no_tokenizer, "no_tokenizer", "WARNING"), (not_a_causal_lm, "not_causal_lm", "WARNING"),
    # transformers logs a report of the parameters it would make up, a warning: ERROR silences it
    (weights_of_another_architecture, "invalid_model", "ERROR"),
])
def test_a_model_that_cannot_load_is_one_line_and_status_2(tmp_path, default_dir, build, code, level):
    build(tmp_path, default_dir)
    done = run("--model", str(tmp_path), "--log-level", level)
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
    (["--chat-template", "/nonexistent.jinja"], "--chat-template applies to the startup model: give --model too"),
    (["--model", "default", "--chat-template", "/dev/zero"], "cannot use --chat-template /dev/zero: it is not a regular file"),
    # the template is read before the model loads: a typo fails at once, whatever the model
    (["--model", "/nonexistent/model", "--chat-template", "/dev/zero"], "cannot use --chat-template /dev/zero: it is not"),
    (["--fds", "99,98"], "--fds: descriptor 99 is not open; it must be open to be read"),
    (["--fds", "2147483648,1"], "--fds: descriptor 2147483648 is not a descriptor number"),
    (["--fds", "1,1"], "--fds: descriptor 1 is open the other way; it must be open to be read"),  # stdout: a pipe's write end
    (["--max-frame-bytes", str(2**64)], "argument --max-frame-bytes: invalid integer from 0 to 2^63-1 value"),
    (["--cache-budget-bytes", "0"], "argument --cache-budget-bytes: invalid integer from 1 to 2^63-1 value"),
    (["--threads", "0"], "argument --threads: invalid integer from 1 to 1024 value"),
    (["--threads", str(2**63 - 1)], "argument --threads: invalid integer from 1 to 1024 value"),
    (["--stream-interval-ms", "nan"], "argument --stream-interval-ms: invalid number of milliseconds from 0 to 60000"),
    (["--stderr", "/nonexistent/dir/log"], "--stderr: cannot open /nonexistent/dir/log: No such file or directory"),
    # an empty value was taken as no flag at all: no model, a session directory off, stderr where it was
    (["--model", ""], "--model is empty: give a value, or leave the flag out"),
    (["--model", "default", "--session-dir", ""], "--session-dir is empty"),
    (["--model", "default", "--stderr", ""], "--stderr is empty"),
    (["--model", "default", "--chat-template", ""], "--chat-template is empty"),
    # ignored: a later load_model took the dtype of the model's config
    (["--dtype", "f16"], "--dtype applies to the startup model: give --model too"),
    (["--model", "default", "--fds", ""], "--fds is empty"),  # served on stdin and stdout instead
    (["--model", "default", "--model-root", ""], "--model-root is empty"),  # the working directory, before
])
def test_bad_options_are_one_clear_line(default_dir, args, says):
    done = run(*args)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr


@pytest.mark.parametrize("option", ["--model", "--model-root", "--session-dir"])
def test_a_loop_of_symbolic_links_is_one_clear_line(tmp_path, option):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    done = run(option, str(tmp_path / "a" / "x"), *([] if option == "--model" else ["--model", "default"]))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"argument {option}: '{tmp_path}/a/x' is not a usable path: " in done.stderr


def test_a_model_path_longer_than_the_system_takes_is_one_clear_line(tmp_path):
    done = run("--model", str(tmp_path / ("a" * 300)))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "File name too long: no model directory at" in done.stderr and "(model_not_found)" in done.stderr


def test_a_chat_template_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "template.jinja"
    os.mkfifo(fifo)
    done = run("--model", "/nonexistent/model", "--chat-template", str(fifo))  # hung for ever: open() waited
    assert done.returncode == 2 and f"cannot use --chat-template {fifo}: it is not a regular file" in done.stderr


@pytest.mark.parametrize("content, says", [
    (b"{{ messages[0]['content'] }\n", "cannot use --chat-template"),  # a Jinja syntax error
    (b"{{ '\xff' }}", "it is not UTF-8 text (byte 4)"),
    (b"{# a template #}" + b" " * (1 << 20), "it is larger than 1048576 bytes"),
    (b" \n", "it is empty"),  # a traceback from the check of the model's template, left with none
])
def test_a_chat_template_that_cannot_serve_fails_the_start(tmp_path, default_dir, content, says):
    path = tmp_path / "template.jinja"
    path.write_bytes(content)
    done = run("--model", "default", "--chat-template", str(path), "--log-level", "WARNING")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert says in lines[0]


@pytest.mark.parametrize("closed, says", [
    (1, "stdout (descriptor 1) is not open; the protocol is served on stdin and stdout, so it must be open to be written"),
    (0, "stdin (descriptor 0) is not open; the protocol is served on stdin and stdout, so it must be open to be read"),
])
def test_a_closed_stdin_or_stdout_is_one_clear_line(closed, says):
    """A closed stdout was a traceback (its duplicate could not be made); with stdin closed, that duplicate
    took descriptor 0 and the server served on "fds 0,0" until it read its own output's end."""
    done = subprocess.run([sys.executable, "-m", "sidecar", "--model", "default"], capture_output=True, text=True,
                          timeout=120, preexec_fn=lambda: os.close(closed))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr


def test_an_output_that_cannot_be_written_stops_the_server_with_one_line_and_status_1(default_dir):
    """A write that fails other than by a closed pipe (a full disk) was a traceback, then another from the
    attempt to report it, then a thousand lines of leak reports from an interpreter left to tear down."""
    from protocol import frame, pack

    with open("/dev/full", "wb") as full:
        server = subprocess.Popen([sys.executable, "-m", "sidecar", "--model", "default", "--log-level", "WARNING"],
                                  stdin=subprocess.PIPE, stdout=full, stderr=subprocess.PIPE)
    server.stdin.write(frame(pack({"id": 1, "op": "hello"})))
    server.stdin.flush()  # and kept open: a client still there, whose replies cannot be written
    try:
        stderr = server.stderr.read().decode()
        assert server.wait(timeout=120) == 1 and "Traceback" not in stderr, stderr
    finally:
        server.kill()
        server.stdin.close()
    assert stderr.strip().splitlines()[-1].endswith("cannot write to the protocol output: No space left on device; exiting")
    assert len(stderr.strip().splitlines()) == 1, stderr


def test_an_output_that_fails_mid_stream_stops_the_server_with_one_line_and_status_1(tmp_path, default_dir):
    """The same failure once replies and events have gone out: a file the server may write only so far
    (RLIMIT_FSIZE, with SIGXFSZ ignored, gives EFBIG) fails while a generation streams."""
    from protocol import FrameDecoder, frame, pack, unpack

    limit = 32 * 1024  # hello's reply is about 7 KB; 1,500 token events are about 60 KB

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    output = tmp_path / "output"
    with open(output, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "sidecar", "--model", "default", "--log-level", "WARNING"],
                                  stdin=subprocess.PIPE, stdout=out, stderr=subprocess.PIPE, preexec_fn=limited)
    server.stdin.write(b"".join(frame(pack(m)) for m in (
        {"id": 1, "op": "hello"}, {"id": 2, "op": "open_session", "session": "s"},
        {"id": 3, "op": "generate", "session": "s", "prompt": "a", "max_new_tokens": 1500, "eos_token_ids": [],
         "stream": True})))
    server.stdin.flush()  # and kept open, as above
    try:
        status = server.wait(timeout=120)
        stderr = server.stderr.read().decode()
        assert status == 1 and "Traceback" not in stderr, stderr
    finally:
        server.kill()
        server.stdin.close()
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("cannot write to the protocol output: File too large; exiting"), stderr
    written = output.read_bytes()
    assert 0 < len(written) <= limit
    messages = [unpack(body) for body in FrameDecoder().feed(written)]  # a frame cut short at the end is left
    assert [m["id"] for m in messages[:2]] == [1, 2] and messages[0]["ok"] and messages[1]["ok"]
    assert len(messages) > 10 and all(m.get("event") == "token" for m in messages[2:]), messages[:3]


@pytest.mark.parametrize("threads", [1, 3])
def test_threads_sets_the_threads_of_the_forward_passes(threads):
    done = run("--model", "default", "--threads", str(threads), "--log-level", "INFO")
    assert done.returncode == 0 and f"forward passes on {threads} thread(s)" in done.stderr, done.stderr


def test_a_chat_template_that_refuses_a_lone_user_message_still_serves(tmp_path, default_dir):
    """The start checks the template renders; one that refuses the conversation it is tried on (it wants
    a system message) is valid, and serves until its input closes."""
    path = tmp_path / "template.jinja"
    path.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    done = run("--model", "default", "--chat-template", str(path), "--log-level", "WARNING")
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_stderr_fifo_nobody_reads_fails_the_start_instead_of_blocking(tmp_path):
    fifo = tmp_path / "log"
    os.mkfifo(fifo)
    done = run("--stderr", str(fifo), timeout=60)
    assert done.returncode == 2 and "--stderr: cannot open" in done.stderr and "Traceback" not in done.stderr


def test_ctrl_c_stops_the_server_without_a_traceback(default_dir):
    import signal

    from protocol import FrameDecoder, frame, pack

    server = subprocess.Popen([sys.executable, "-m", "sidecar", "--model", "default", "--log-level", "WARNING"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    server.stdin.write(frame(pack({"id": 1, "op": "ping"})))
    server.stdin.flush()
    decoder, replies = FrameDecoder(), []
    while not replies:  # serving
        replies = decoder.feed(os.read(server.stdout.fileno(), 4096))
    server.send_signal(signal.SIGINT)
    assert server.wait(60) == 130
    stderr = server.stderr.read().decode()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    server.stdin.close()


def test_version():
    done = run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"python -m sidecar {__version__} (protocol 1)"
