"""The quick-start demo runs, tells its story, and fails on a bad model with one line."""

import subprocess
import sys


def test_the_demo_shows_each_reuse_case_and_a_chat(default_dir):
    done = subprocess.run([sys.executable, "-m", "sidecar.demo"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    for words in ("prefix", "different suffix", "rolling", "warm", "chat"):
        assert words in done.stdout.lower(), f"the demo never mentions {words!r}"


def test_the_demo_with_a_bad_model_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sidecar.demo", "--model", str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "model_not_found" in done.stderr
