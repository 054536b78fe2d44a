"""`Chain`: processors zipped with a tuple of their states, as Bumblebee's generation loop does."""

from __future__ import annotations

import inspect
from typing import Callable, Iterable, Union

import torch

from .contract import Context, FunctionProcessor, LogitsProcessor
from .errors import InvalidInput, InvalidOption, ProcessorError

Item = Union[LogitsProcessor, Callable[[torch.Tensor, Context], torch.Tensor]]


def _check_arguments(function, index: int) -> None:
    """A plain callable is called as f(logits, context) at every step: one that cannot take those two
    arguments is refused here, rather than with a raw TypeError in the middle of a generation. A callable
    whose signature Python cannot read (some builtins) is left to its call."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise InvalidOption(f"processors[{index}] is called as f(logits, context), and "
                            f"{getattr(function, '__name__', type(function).__name__)}{signature} cannot take those "
                            f"two arguments", index=index) from None


def _is_transformers_processor_class(cls: type) -> bool:
    """Whether `cls` is a transformers `LogitsProcessor` (found by name: this module does not import transformers)."""
    return any(c.__name__ == "LogitsProcessor" and c.__module__.startswith("transformers.") for c in cls.__mro__)


def _is_transformers_list(p) -> bool:
    return isinstance(p, list) and type(p).__name__ == "LogitsProcessorList" and type(p).__module__.startswith("transformers.")


class Chain:
    """An ordered list of processors; plain callables `f(logits, context) -> logits` become stateless ones, and
    transformers' own `LogitsProcessor`s are called as transformers calls them."""

    __slots__ = ("processors", "max_token_id", "indices")

    def __init__(self, processors: Iterable[Item] = ()):
        items = []
        for index, p in enumerate(processors):
            if isinstance(p, LogitsProcessor):
                items.append(p)
            elif isinstance(p, type) and issubclass(p, LogitsProcessor):  # callable, but not f(logits, context)
                raise InvalidOption(f"processors[{index}] is the class {p.__name__}, not a processor: configure it, "
                                    f"configure({p.__name__}, option=value, ...)", index=index)
            elif _is_transformers_processor_class(type(p)):  # called as p(input_ids, scores), the other way round
                from .hf import from_hf_logits_processor

                items.append(from_hf_logits_processor(p))
            elif isinstance(p, type) and _is_transformers_processor_class(p):
                raise InvalidOption(f"processors[{index}] is the class {p.__name__}, not a processor: make one, "
                                    f"{p.__name__}(...)", index=index)
            elif _is_transformers_list(p):
                raise InvalidOption(f"processors[{index}] is a {type(p).__name__}: give its processors, "
                                    "processors=[*the_list, ...], or the list itself as processors", index=index)
            elif callable(p):
                _check_arguments(p, index)
                items.append(FunctionProcessor(p))
            else:
                raise InvalidOption(f"a chain holds processors or callables f(logits, context), got {p!r}")
        self.processors: tuple[LogitsProcessor, ...] = tuple(items)
        named = [p.max_token_id() for p in items]
        for index, (processor, top) in enumerate(zip(items, named)):
            if not isinstance(top, int) or isinstance(top, bool):
                raise InvalidOption(f"processors[{index}] ({processor.name}): max_token_id() must return an int, "
                                    f"got {type(top).__name__}", index=index)
        # the largest token id any processor names (-1 for none): checked against the vocabulary
        self.max_token_id = max(named, default=-1)
        # each processor's place in the chain as given, which errors name (`bind` moves constraints first)
        self.indices: tuple[int, ...] = tuple(range(len(items)))

    def __len__(self) -> int:
        return len(self.processors)

    def __repr__(self) -> str:
        return f"Chain({list(self.processors)!r})"

    def bind(self, vocabulary, eos_token_ids, device="cpu") -> "Chain":
        """The chain ready for one model: constraints compiled against `vocabulary` (see `LogitsProcessor.bind`)
        and moved to the front, the others keeping their order.

        A constraint is a hard rule on the text; every other processor then chooses among the tokens it
        allows. The other way round, a `TopK(2)` before a regex would keep two tokens the regex forbids
        and leave it nothing. transformers runs its logits processors before its sampling warpers, and
        vLLM applies its grammar bitmask before sampling, for the same reason.
        """
        ordered = sorted(enumerate(self.processors), key=lambda pair: not pair[1].constrains)
        bound = []
        for position, (index, processor) in enumerate(ordered):
            try:
                bound.append(processor.bind(vocabulary, eos_token_ids, device, after_others=position > 0))
            except ProcessorError as error:
                bound.clear()  # the error's traceback holds this frame: what was bound goes now, not with it
                raise error.at(index, processor.name) from error
        chain = Chain(bound)
        chain.indices = tuple(self.indices[index] for index, _ in ordered)
        return chain

    def init(self, context: Context) -> tuple:
        check_context(context)
        check_token_ids(context)
        states = tuple([p.init(context) for p in self.processors])  # a StopIteration out of a generator would be a RuntimeError
        rows = context.sequence.shape[0]
        for index, processor, state in zip(self.indices, self.processors, states):
            check_state(state, rows, processor.name, index)
        return states

    def process(self, states: tuple, logits: torch.Tensor, context: Context) -> tuple[tuple, torch.Tensor]:
        """Runs one step. Inputs are checked first (their kinds and shapes: the tokens of the sequence were
        checked at `init`, and those appended since are trusted, as sampled from logits as wide as the
        vocabulary) and never modified, so a step they refuse changes nothing. Each state a processor
        returns is checked as `init`'s was: one that stopped leading with the rows would be reordered
        wrongly, or silently, at the next reorder (a few microseconds a processor)."""
        check_step(logits, context, self.max_token_id)
        self._check_states(states)
        rows = logits.shape[0]
        new_states = []
        for position, (processor, state) in enumerate(zip(self.processors, states)):
            try:
                returned = processor.process(state, logits, context)
            except ProcessorError as error:  # say which processor, if it did not
                if error.index is None:
                    error.index = self.indices[position]
                raise
            if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
                index = self.indices[position]
                raise InvalidInput(f"processors[{index}] ({processor.name}): process must return a pair (state, "
                                   f"logits), got {_kind(returned)}", index=index)
            state, logits = returned
            check_state(state, rows, processor.name, self.indices[position], "its returned state")
            new_states.append(state)
        return tuple(new_states), logits

    def reorder(self, states: tuple, index: torch.Tensor) -> tuple:
        """Selects or reorders batch rows of every state (beam search, dropping finished rows)."""
        self._check_states(states)
        if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype not in (torch.long, torch.int):
            got = f"{tuple(index.shape)} {index.dtype}" if isinstance(index, torch.Tensor) else type(index).__name__
            raise InvalidInput(f"the index of the rows to keep must be a 1-D int64 (or int32) tensor, got {got}")
        reordered = []
        for position, (processor, state) in enumerate(zip(self.processors, states)):
            try:
                reordered.append(processor.reorder(state, index))
            except (TypeError, IndexError) as error:  # a state that changed shape or kind since `init`
                at = self.indices[position]
                raise InvalidInput(f"processors[{at}] ({processor.name}): its state cannot follow the rows "
                                   f"({str(error)[:200]}); a state keeps the shape `init` gave it, per-row tensors "
                                   f"leading with the rows", index=at) from error
        return tuple(reordered)

    def _check_states(self, states) -> None:
        """One state per processor, as `init` returned them: a shorter tuple would skip processors silently."""
        if not isinstance(states, (tuple, list)) or len(states) != len(self.processors):
            got = f"{len(states)} states" if isinstance(states, (tuple, list)) else _kind(states)
            raise InvalidInput(f"the chain has {len(self.processors)} processors and was given {got}: pass the "
                               f"states `init` returned (or the last step's), one per processor")


def check_state(state, rows: int, name: str, index: int, path: str = "state") -> None:
    """A state's tensors are per-row (leading with the rows) or shared by every row (0-dim), nothing between.

    Bumblebee's own example keeps a shared value as `tensor([x])`: with several rows (beams, samples), no
    single index can reorder that, so it is refused here, at `init` and at every step (what `process`
    returned), instead of failing, or reordering wrongly, at some later step.
    """
    if isinstance(state, torch.Tensor):
        if state.dim() > 0 and state.shape[0] != rows:
            raise InvalidInput(
                f"processors[{index}] ({name}): {path} has shape {tuple(state.shape)} but there are {rows} rows; a "
                f"per-row state leads with the rows (e.g. torch.full(({rows},), x)), a state shared by every row is "
                f"a 0-dim tensor (torch.tensor(x))", index=index)
    elif isinstance(state, tuple):
        for i, item in enumerate(state):
            check_state(item, rows, name, index, f"{path}[{i}]")
    elif isinstance(state, dict):
        for key, item in state.items():
            check_state(item, rows, name, index, f"{path}[{key!r}]")
    else:
        raise InvalidInput(f"processors[{index}] ({name}): {path} is of type {type(state).__name__}; a state is tensors, "
                           f"tuples or dicts of them", index=index)


# What a sequence of token ids may be held in (bool, float and complex tensors are refused).
INTEGER_DTYPES = frozenset(getattr(torch, name) for name in ("uint8", "int8", "int16", "int32", "int64", "uint16",
                                                             "uint32", "uint64") if hasattr(torch, name))


def check_context(context: Context) -> None:
    """Checked at every step (Chain.process), so the usual case costs three type tests; the loop that names
    a field runs only when one of them fails."""
    seq = context.sequence
    if not isinstance(seq, torch.Tensor) or seq.dim() != 2 or seq.dtype not in INTEGER_DTYPES:
        got = f"{tuple(seq.shape)} {seq.dtype}" if isinstance(seq, torch.Tensor) else type(seq).__name__
        raise InvalidInput(f"context.sequence must be a B x T integer tensor, got {got}")
    if not (type(context.length) is int and type(context.input_length) is int and type(context.vocab_size) is int):
        for field in ("length", "input_length", "vocab_size"):
            value = getattr(context, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidInput(f"context.{field} must be an integer, got {type(value).__name__} {value!r}")
    if context.vocab_size < 1:
        raise InvalidInput(f"context.vocab_size must be at least 1, got {context.vocab_size}")
    if not 0 <= context.input_length <= context.length <= seq.shape[1]:
        raise InvalidInput(
            f"context lengths must satisfy 0 <= input_length ({context.input_length}) <= length "
            f"({context.length}) <= sequence width ({seq.shape[1]})"
        )


def check_token_ids(context: Context, start: int = 0) -> None:
    """The sequence's tokens from `start` to `length` are ids of the vocabulary (a processor indexing its
    per-token state with one outside would fail deep inside torch). Once per generation, at `init`: a step
    trusts the tokens its caller appended."""
    tokens = context.sequence[:, start : context.length]
    if not tokens.numel():
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= context.vocab_size:
        raise InvalidInput(f"context.sequence holds token id {low if low < 0 else high}, outside the vocabulary of "
                           f"{context.vocab_size}")


def check_step(logits: torch.Tensor, context: Context, max_token_id: int) -> None:
    if not isinstance(logits, torch.Tensor):
        raise InvalidInput(f"logits must be a tensor, got {type(logits).__name__}")
    if not logits.dtype.is_floating_point:
        raise InvalidInput(f"logits must have a floating dtype, got {logits.dtype}")
    if logits.dim() != 2:
        raise InvalidInput(f"logits must be B x V (rank 2), got rank {logits.dim()}")
    check_context(context)
    batch, vocab = logits.shape
    if context.sequence.shape[0] != batch:
        raise InvalidInput(f"logits have {batch} rows but the sequence has {context.sequence.shape[0]}")
    if vocab != context.vocab_size:
        raise InvalidInput(f"logits have {vocab} columns but context.vocab_size is {context.vocab_size}")
    if max_token_id >= vocab:
        raise InvalidInput(f"a processor names token id {max_token_id}, outside the vocabulary of {vocab}")


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__name__}"
