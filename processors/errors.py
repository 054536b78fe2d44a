"""Typed errors of the processors package.

Both are `ValueError`s, so callers that only know the builtin still catch them; each carries the stable
`code` that the protocol reuses in its error replies.
"""


class ProcessorError(ValueError):
    code = "invalid_processor"

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index  # the processor's place in the chain as given, when a chain raised it


class InvalidOption(ProcessorError):
    """A configure-time problem: unknown option, missing option, wrong type or out of range."""

    code = "invalid_option"


class InvalidInput(ProcessorError):
    """A step-time problem with the logits or the context handed to a processor."""

    code = "invalid_input"
