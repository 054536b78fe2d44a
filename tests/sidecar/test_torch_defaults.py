"""A model loading on one thread does not change torch's default dtype under another thread's work."""

import threading
import time

import torch

from sidecar import models
from sidecar.torch_defaults import DEFAULTS, Gate


def test_a_bf16_load_waits_for_the_work_under_way_and_never_shows_its_dtype(default_dir):
    loaded = {}

    def load():
        loaded["model"] = models.load(default_dir, dtype="bfloat16")[0]

    loader = threading.Thread(target=load)
    with DEFAULTS.using():
        loader.start()
        seen = set()
        until = time.monotonic() + 3  # the load alone takes a tenth of that: it waits at building the modules
        while time.monotonic() < until:
            seen.add(torch.get_default_dtype())
            seen.add(torch.full((1,), 0.5).dtype)
        assert loader.is_alive() and "model" not in loaded
        assert seen == {torch.float32}
    loader.join(timeout=120)
    assert loaded["model"].dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32


def test_uses_share_the_gate_a_change_waits_for_them_and_a_later_use_for_the_change():
    gate, log = Gate(), []
    holding, release = threading.Event(), threading.Event()

    def use(name, hold=False):
        with gate.using():
            log.append(name)
            if hold:
                holding.set()
                release.wait(30)

    def change():
        with gate.changing():
            log.append("change")

    held = threading.Thread(target=use, args=("held use", True))
    held.start()
    assert holding.wait(30)
    with gate.using():  # a use beside another thread's
        log.append("shared use")
    changer = threading.Thread(target=change)
    changer.start()
    while not gate._changing:  # the change is asked for, and waits for the held use
        time.sleep(0.001)
    later = threading.Thread(target=use, args=("later use",))
    later.start()
    time.sleep(0.2)
    assert log == ["held use", "shared use"]
    release.set()
    for thread in (held, changer, later):
        thread.join(30)
    assert log == ["held use", "shared use", "change", "later use"]


def test_a_thread_that_uses_the_defaults_may_change_them_itself():
    gate = Gate()
    with gate.using(), gate.changing(), gate.using():
        pass
