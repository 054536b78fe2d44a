"""Every error the engine raises. Each has a stable `code`, which the protocol puts in its error replies.

A request that fails with one of these changed nothing: validation runs before any session state moves,
and a generation that fails later (for example `invalid_logits` at some step) puts its session back as
it was before the call.
"""

from __future__ import annotations

from processors.errors import OverLimit


class SidecarError(Exception):
    code = "internal"

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.message = message
        self.details = details


class ModelNotFound(SidecarError):
    code = "model_not_found"


class NotCausalLM(SidecarError):
    code = "not_causal_lm"


class NoTokenizer(SidecarError):
    code = "no_tokenizer"


class RemoteCodeRequired(SidecarError):
    code = "remote_code_required"


class InvalidModel(SidecarError):
    """A model directory whose config or weights cannot be read (missing, malformed, or refused as unsafe)."""

    code = "invalid_model"


class NoChatTemplate(SidecarError):
    """Chat messages were given, but the model has no chat template and none was named."""

    code = "no_chat_template"


class InvalidArgument(SidecarError):
    code = "invalid_argument"


class EmptyInput(SidecarError):
    code = "empty_input"


class TokenOutOfRange(SidecarError):
    code = "token_out_of_range"


class ContextOverflow(SidecarError):
    code = "context_overflow"


class UnknownStrategy(SidecarError):
    code = "unknown_strategy"


class SessionClosed(SidecarError):
    code = "session_closed"


class InvalidProcessor(SidecarError):
    """A processor name or option was rejected by `processors.configure` (its message names which)."""

    code = "invalid_processor"


class InvalidLogits(SidecarError):
    """The processors left nothing to sample from: every token removed, or a +inf / NaN logit."""

    code = "invalid_logits"


class SessionBusy(SidecarError):
    """A session runs one generation at a time; the previous one must finish or be cancelled first."""

    code = "session_busy"


class ReplyTooLarge(SidecarError):
    """The reply to a generate would not fit in one frame (the server's `max_frame_bytes`)."""

    code = "limit_exceeded"


class LimitExceeded(SidecarError):
    """A request would take a resource past its limit (`limit`, with `max` and `value`), as a generation
    binding constraints whose tables pass `constraint_budget_bytes`."""

    code = "limit_exceeded"


class CacheBudgetExceeded(SidecarError):
    """A generation needs more KV memory than the cache budget holds, even with every idle cache evicted."""

    code = "cache_budget_exceeded"


class UnknownDevice(SidecarError):
    """A device name torch does not know, or a device this machine does not have."""

    code = "unknown_device"


class InvalidSessionFile(SidecarError):
    """A saved session that cannot be restored: unreadable, truncated, corrupted, or from another model or dtype."""

    code = "invalid_session_file"


class SaveFailed(SidecarError):
    """A session could not be written (the disk is full, the directory not writable...); nothing was left behind."""

    code = "save_failed"


class SampleMismatch(SidecarError):
    """A sequence to continue named by a count of samples that does not fit: a result of several sequences
    continued as a whole (continue one of them), or an index past the last result's sequences."""

    code = "sample_mismatch"


class TokenizerMismatch(SidecarError):
    """A sequence to continue made by another engine: its token ids may spell other text in this one."""

    code = "tokenizer_mismatch"


def refusal_of(error) -> InvalidProcessor | LimitExceeded:
    """A processor's typed error (`processors.ProcessorError`, from a chain as it binds or steps) as the
    engine's: a limit it names stays a limit (`limit_exceeded`, with `limit`, `max` and `value`), anything
    else is `invalid_processor`; with the processor's index when the chain knew it."""
    index = {"index": error.index} if error.index is not None else {}
    if isinstance(error, OverLimit):
        return LimitExceeded(str(error), limit=error.limit, max=error.maximum, value=error.value, **index)
    return InvalidProcessor(str(error), **index)
