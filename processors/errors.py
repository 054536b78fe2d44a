"""Typed errors of the processors package.

Both are `ValueError`s, so callers that only know the builtin still catch them; each carries the stable
`code` that the protocol reuses in its error replies.
"""

import copy


class ProcessorError(ValueError):
    code = "invalid_processor"

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index  # the processor's place in the chain as given, when a chain raised it

    def at(self, index: int, name: str) -> "ProcessorError":
        """This error raised by the chain's processor `index`, named `name`: its message says which, and
        whatever else it carries stays."""
        located = copy.copy(self)
        located.args = (f"processors[{index}] ({name}): {self}",)
        located.index = index
        return located


class InvalidOption(ProcessorError):
    """A configure-time problem: unknown option, missing option, wrong type or out of range."""

    code = "invalid_option"


class InvalidInput(ProcessorError):
    """A step-time problem with the logits or the context handed to a processor."""

    code = "invalid_input"


class OverLimit(ProcessorError):
    """Binding or running a processor would take a resource past a limit: `limit` names it, `maximum` is
    its value and `value` what the processor came to."""

    code = "limit_exceeded"
    limit = ""

    def __init__(self, message: str, index: int | None = None, value: float = 0, maximum: float = 0):
        super().__init__(message, index)
        self.value, self.maximum = value, maximum
