"""The logits-processor contract, shaped exactly like Bumblebee's.

A processor is an immutable config (a frozen dataclass whose fields are its options) with two callbacks:

    init(self, context) -> state
    process(self, state, logits, context) -> (state, logits)

`self` is the config. A state is a tensor or a tuple/dict of tensors whose structure and shapes never
change between steps; tensors with at least one dimension are per-row and lead with the batch, 0-dim
tensors are shared by all rows. That convention is what lets `reorder` follow beam search or drop
finished rows with one index tensor instead of hashing token histories.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from .errors import InvalidOption

State = Any


@dataclass(frozen=True)
class Context:
    """What a processor sees at each step (Bumblebee's process context).

    `sequence` is B x T int64 and may be longer than `length`, as in Bumblebee's preallocated loop: only
    `sequence[:, :length]` is meaningful. `vocab_size` is our one addition: `init` has no logits yet and
    stateful processors need it to allocate per-token state.
    """

    sequence: torch.Tensor
    length: int
    input_length: int
    vocab_size: int

    @property
    def tokens(self) -> torch.Tensor:
        """The meaningful part of `sequence`."""
        return self.sequence[:, : self.length]


def option(doc: str, *, default: Any = dataclasses.MISSING, check: Callable[[str, Any], Any] | None = None):
    """Declares one option: its doc, its default and the check that validates and normalises it."""
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check})


class LogitsProcessor:
    """Base of every processor config. Subclasses are frozen dataclasses built with `option` fields."""

    name: ClassVar[str]
    constrains: ClassVar[bool] = False  # a hard rule on the text: bound chains run these first

    def __post_init__(self):
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))
        self.validate()

    def validate(self) -> None:
        """Cross-option checks; raise `InvalidOption`. Runs at configure time, never at step time."""

    def max_token_id(self) -> int:
        """The largest token id this config names (-1 for none), checked against the vocabulary."""
        return -1

    def bind(self, vocabulary, eos_token_ids, device="cpu", after_others=True) -> "LogitsProcessor":
        """This processor ready for one model: constraints compile against its vocabulary; others are unchanged.

        `after_others` says whether other processors run before this one: only then can a constraint find
        every token it allows already removed, and need to check for it at each step.
        """
        return self

    def init(self, context: Context) -> State:
        return ()

    def process(self, state: State, logits: torch.Tensor, context: Context) -> tuple[State, torch.Tensor]:
        raise NotImplementedError

    def reorder(self, state: State, index: torch.Tensor) -> State:
        return reorder_rows(state, index)


class StatelessProcessor(LogitsProcessor):
    """A processor that is a pure function of (logits, context); Bumblebee's built-ins mostly are."""

    def transform(self, logits: torch.Tensor, context: Context) -> torch.Tensor:
        raise NotImplementedError

    def process(self, state, logits, context):
        return state, self.transform(logits, context)


@dataclass(frozen=True)
class FunctionProcessor(StatelessProcessor):
    """Wraps a plain `f(logits, context) -> logits` as a stateless processor."""

    name: ClassVar[str] = "function"
    fun: Callable[[torch.Tensor, Context], torch.Tensor] = option("the function applied to the logits")

    def transform(self, logits, context):
        return self.fun(logits, context)


def reorder_rows(state: State, index: torch.Tensor) -> State:
    """Selects rows of every per-row tensor of a state; shared (0-dim) tensors are kept as they are."""
    if isinstance(state, torch.Tensor):
        return state.index_select(0, index) if state.dim() > 0 else state
    if isinstance(state, tuple):
        return tuple(reorder_rows(s, index) for s in state)
    if isinstance(state, dict):
        return {k: reorder_rows(v, index) for k, v in state.items()}
    raise TypeError(f"a processor state must be tensors, tuples or dicts, got {type(state).__name__}")


def options_of(cls: type[LogitsProcessor]) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def describe(cls: type[LogitsProcessor]) -> list[dict[str, Any]]:
    """The declared options of a processor: name, doc, default (None when required) and JSON Schema."""
    return [
        {
            "name": f.name,
            "doc": f.metadata.get("doc", ""),
            "required": f.default is dataclasses.MISSING,
            "default": None if f.default is dataclasses.MISSING else f.default,
            "schema": getattr(f.metadata.get("check"), "schema", {}),
        }
        for f in options_of(cls).values()
    ]


def configure(cls_or_config, **options) -> LogitsProcessor:
    """Builds a config from a processor class, or updates an existing config, validating every option.

    Unknown options are rejected by name with the list of valid ones, like `Bumblebee.configure/2`.
    """
    cls = cls_or_config if isinstance(cls_or_config, type) else type(cls_or_config)
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor) and dataclasses.is_dataclass(cls)):
        raise InvalidOption(f"configure expects a processor class or config, got {cls_or_config!r}")
    valid = options_of(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        shown = ", ".join(repr(name if len(name) <= 64 else name[:61] + "...") for name in unknown[:5])
        raise InvalidOption(
            f"unknown option{'s' if len(unknown) > 1 else ''} {shown}{', ...' if len(unknown) > 5 else ''} for {cls.__name__}; "
            f"valid options: {', '.join(valid) or '(none)'}"
        )
    if isinstance(cls_or_config, type):
        missing = [n for n, f in valid.items() if f.default is dataclasses.MISSING and n not in options]
        if missing:
            raise InvalidOption(f"{cls.__name__} requires option{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
        return cls(**options)
    return dataclasses.replace(cls_or_config, **options)
