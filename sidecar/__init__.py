"""The sidecar engine as a Python library: `Engine.load(path).session().generate(...)`."""

__version__ = "0.1.0"

from .engine import Engine
from .errors import SidecarError
from .session import Generation, Result, Session, Stats, TokenEvent

__all__ = ["Engine", "Generation", "Result", "Session", "SidecarError", "Stats", "TokenEvent"]
