"""The sidecar engine as a Python library: `Engine.load(path).session().generate(...)`.

The names below are imported on first use, so that `python -m sidecar` can put the process in offline
mode before anything imports transformers (see `__main__`).
"""

__version__ = "0.1.0"

__all__ = ["Engine", "Generation", "Result", "Sequence", "Session", "SidecarError", "Stats", "TokenEvent"]

_HOMES = {"Engine": "engine", "SidecarError": "errors", "Generation": "generation", "Result": "session",
          "Sequence": "session", "Session": "session", "Stats": "session", "TokenEvent": "session"}


def __getattr__(name):
    if name not in _HOMES:
        raise AttributeError(f"module 'sidecar' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
