"""`Grammar`: a context-free constraint in Lark syntax, which no finite automaton can express, run by llguidance.

A pushdown constraint has no finite table of states to precompute, so each row keeps an llguidance matcher
(its parser) and the processor's state holds, per row, the index of that row's matcher in a pool shared by
the generation. `Chain.reorder` moves the indices with their beams as it moves any per-row state; two rows
left pointing at one matcher after a reorder get their own copy when they next consume a token.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import math
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..contract import LogitsProcessor, option
from ..errors import InvalidInput, InvalidOption, OverLimit
from .constraints import NEG_INF, Constraint, _pattern, _validate_grammar, rust_panics_as
from .locks import ForkSafeLock


# llguidance checks a grammar, and builds its parser, by recursion over chains of rules: the longest chain
# that fits in max_pattern_chars (12,748 rules `ab:ac`) needs 32-64 MiB of stack, where a thread has 8 MiB,
# and running out of it kills the process. So both run on a thread of their own with this much stack: address
# space reserved, touched only as deep as the grammar goes. A parser once built steps on any thread.
GRAMMAR_STACK_BYTES = 256 << 20
_stack_size_lock = ForkSafeLock()  # threading.stack_size is the process's, for threads started meanwhile

# Start matchers kept (`start_matcher`): one of a JSON schema or Lark grammar of max_pattern_chars holds
# 8-14 MB with the default model's vocabulary.
STARTED = 8
_started: OrderedDict = OrderedDict()  # (constraint name, grammar, vocabulary fingerprint) -> matcher or refusal
_started_lock = ForkSafeLock()  # the server's compile threads make them, its main thread binds them
PROBE_TOKENS = 8  # tokens of one text a new start matcher is stepped through, to find where its parser gives up

# The time the grammars of one generation may take in one step, every row's token consumed and mask made: they
# run in the step of every generation batched with it, and llguidance's own limits bound their memory, not their
# time. An ambiguous grammar (`s: s s | /[a-z]/`, 30 bytes) takes longer at every token, 0.2 s a step at token
# 130 and 2 s at 290 (the default model's 1,024 tokens), where a grammar that parses one way takes well under a
# millisecond a row; 64 rows of it held every other session for 10 s a step. Ours: --grammar-step-ms.
DEFAULT_STEP_LIMIT_S = 0.1
_step_limit_s = DEFAULT_STEP_LIMIT_S
# What the grammars of the chain step under way on this thread took so far: the step's `Context` (one object for
# every processor of a chain's step) and the seconds, so that a generation's many grammars count together.
_step = threading.local()


class _CollectorTime(threading.local):
    """The CPU seconds Python's garbage collector took on this thread while grammar steps ran (`gc.callbacks`):
    a collection that an allocation in a step sets off is the heap's cost, not the grammar's, and a full one of
    a large heap (a process holding several vocabularies' structures) took 240-260 ms, failing a step of 0.2 ms.
    Counted only while a step runs (`_collections_counted`): a callback makes every collection 50x dearer."""

    spent = 0.0
    started: float | None = None


_collector = _CollectorTime()
_counting_steps = 0  # grammar steps running, on any thread, while `_count_collection` is registered
_counting_lock = ForkSafeLock()


def _count_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _collector.started = time.thread_time()
    elif _collector.started is not None:
        _collector.spent += time.thread_time() - _collector.started
        _collector.started = None


@contextlib.contextmanager
def _collections_counted():
    global _counting_steps
    with _counting_lock:
        if not _counting_steps:
            gc.callbacks.append(_count_collection)
        _counting_steps += 1
    try:
        yield
    finally:
        with _counting_lock:
            _counting_steps -= 1
            if not _counting_steps and _count_collection in gc.callbacks:  # (the list is anyone's to clear)
                gc.callbacks.remove(_count_collection)


def _gone():
    return None


def set_step_limit_s(seconds: float) -> None:
    """The most time the grammars of one generation may take in one step, for the generations that bind them from
    now on."""
    global _step_limit_s
    if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 < seconds < float("inf")):
        raise ValueError(f"a grammar's step limit is a positive number of seconds, got {seconds!r}")
    _step_limit_s = float(seconds)


def step_limit_ms() -> float | int:
    """The limit `set_step_limit_s` set, in milliseconds (an int when whole), as a server reports it."""
    ms = round(_step_limit_s * 1e3, 3)
    return int(ms) if ms == int(ms) else ms


class GrammarStepTooSlow(OverLimit):
    """The grammars of a generation took longer than `grammar_step_ms` in one step: the generation stops."""

    limit = "grammar_step_ms"


# The biases of the 8 tokens of each byte of a bitmask, bit j of the byte for its j-th token: 0 if set, else -inf.
_BYTE_BIASES = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                        np.float32(0), np.float32(NEG_INF))


class RunByLlguidance:
    """What a constraint that llguidance runs does the same way (a `Constraint` with `llguidance_grammar`, its
    grammar in llguidance's own format, and `check_grammar`, llguidance's check of it that refuses it): its
    compile is that check, then the start matcher (`start_matcher`). When configured with the checks deferred
    (`llguidance_checks_deferred`), its compile is where it is checked: never bound unchecked."""

    def check_unless_deferred(self) -> None:
        if not _deferred.get():
            self.check_grammar()

    def compiled_for(self, vocabulary) -> bool:
        return is_started(self, self.llguidance_grammar, vocabulary)

    def compile_key(self):
        return (self.name, self.llguidance_grammar)

    def compile(self, vocabulary, cancelled=None):
        self.check_grammar()  # remembered per text: once, whether configuring checked it or not
        return start_matcher(self, self.llguidance_grammar, vocabulary)

    def bind(self, vocabulary, eos_token_ids, device="cpu", after_others=True, compiled=None):
        return bind_llguidance(self, self.llguidance_grammar, vocabulary, eos_token_ids, device, compiled)


@dataclass(frozen=True)
class Grammar(RunByLlguidance, Constraint):
    """The generated text is one `start` of a context-free grammar in Lark syntax (llguidance's dialect:
    `start: ...` rules, "literals", /regex/ terminals, `%ignore`)."""

    name: ClassVar[str] = "grammar"
    grammar: str = option("the grammar, in Lark syntax, whose `start` rule the whole text must match", check=_pattern)

    def validate(self):
        self.check_unless_deferred()

    def check_grammar(self) -> None:
        """llguidance's check of the grammar (63-78 ms at max_pattern_chars, remembered per text)."""
        ok, problem = check_grammar(lambda: self.llguidance_grammar, "grammar")
        if not ok:
            raise InvalidOption(f"option 'grammar' is not a valid Lark grammar: {problem}")

    @functools.cached_property
    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own format (the Lark text wrapped), asked for by each step of a request."""
        import llguidance

        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


_deferred = contextvars.ContextVar("llguidance_checks_deferred", default=False)


@contextlib.contextmanager
def llguidance_checks_deferred():
    """Within it, configuring a constraint llguidance runs leaves llguidance's check of it to its compile
    (`RunByLlguidance`). The server configures a request's processors on its main thread, between the steps
    of every session, and compiles on its compile threads: llguidance's check, which lets go of the GIL,
    took 0.42 s there for a new schema of max_pattern_chars (a burst of four new ones held every stream
    2.2-2.9 s)."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def check_grammar(grammar, option_name: str) -> tuple[bool, str]:
    """llguidance's check (remembered per grammar text) of the grammar `grammar()` writes in its own format,
    on a deep stack; a panic there is the option's `InvalidOption`."""
    with rust_panics_as(InvalidOption, f"option {option_name!r} cannot be checked"):
        return _on_deep_stack(lambda: _validate_grammar(grammar()))


def bind_llguidance(constraint: Constraint, grammar: str, vocabulary, eos_token_ids, device,
                    start=None) -> "GrammarProcessor":
    """`constraint` bound to `vocabulary`, run by llguidance on `grammar` (in llguidance's own format, as its
    `grammar_from_lark` or `grammar_from_json_schema` write it), from `start` (what `start_matcher` made of
    them on another thread) or from `start_matcher` now."""
    eos = constraint.end_tokens(eos_token_ids, vocabulary)
    if start is None:
        start = start_matcher(constraint, grammar, vocabulary)
    return GrammarProcessor(constraint, vocabulary.llguidance_tokenizer(),
                            torch.tensor(eos, dtype=torch.long, device=device), start, _step_limit_s)


def start_matcher(constraint: Constraint, grammar: str, vocabulary):
    """A matcher at the start of `grammar` over `vocabulary`, which every row of a generation copies. A
    grammar whose language the vocabulary cannot begin is refused, as a regex's is when it compiles. Both
    are kept per (constraint kind, grammar, vocabulary) for the last `STARTED` asked for: llguidance builds
    its parser with the vocabulary's lexer, 0.8-1.1 s for a JSON schema of `max_pattern_chars`, and a
    client sends its constraint with every request."""
    key = (constraint.name, grammar, vocabulary.fingerprint)
    with _started_lock:
        made = _started.get(key)
        if made is not None:
            _started.move_to_end(key)
    if made is None:
        made = _start(constraint, grammar, vocabulary)
        with _started_lock:
            _started[key] = made
            while len(_started) > STARTED:
                _started.popitem(last=False)
    if isinstance(made, InvalidOption):
        raise InvalidOption(str(made))
    return made


def forget(fingerprint: str) -> None:
    """Drops the matchers kept over the vocabulary of `fingerprint`."""
    with _started_lock:
        for key in [key for key in _started if key[2] == fingerprint]:
            del _started[key]


def is_started(constraint: Constraint, grammar: str, vocabulary) -> bool:
    """Whether `start_matcher` has what it would make kept."""
    with _started_lock:
        return (constraint.name, grammar, vocabulary.fingerprint) in _started


def _start(constraint: Constraint, grammar: str, vocabulary):
    """The start matcher, or the `InvalidOption` that refuses the grammar over this vocabulary."""
    import llguidance.numpy as llg  # not llguidance.torch, whose import costs 2-3 s (it sets up torch.compile)

    tokenizer = vocabulary.llguidance_tokenizer()
    try:
        with rust_panics_as(InvalidOption, f"the {constraint.name} constraint cannot be bound to the vocabulary"):
            start = _on_deep_stack(lambda: _matcher(tokenizer, grammar))
            llg.fill_next_token_bitmask(start, llg.allocate_token_bitmask(1, tokenizer.vocab_size), 0)
    except InvalidOption as refused:
        return refused
    if start.is_error():
        return InvalidOption(f"the vocabulary cannot write any text that the {constraint.name} constraint accepts "
                             f"({_reason(start)})")
    gave_up = _probe(start, tokenizer)
    if gave_up is not None:
        return InvalidOption(f"the {constraint.name} constraint is too large for llguidance's parser, which gives up "
                             f"{gave_up}")
    return start


def _probe(start, tokenizer) -> str | None:
    """Where llguidance's parser gives up along the first `PROBE_TOKENS` tokens of one text (each step the
    lowest token id it allows, short tokens mostly), or None. Some grammars it accepts and starts exceed a
    limit of its own a token or two in (an object of about 500 or more optional properties: 700 give "Current
    row has 2807 items; max is 2000", after its "{"): found here, on the compile thread, they are refused before the
    generation starts, not after its prompt's prefill."""
    import llguidance.numpy as llg

    matcher, bitmask = start.deep_copy(), llg.allocate_token_bitmask(1, tokenizer.vocab_size)
    for step in range(PROBE_TOKENS):
        llg.fill_next_token_bitmask(matcher, bitmask, 0)
        if matcher.is_error():
            return f"after {step} tokens: {_reason(matcher)}"
        allowed = np.flatnonzero(np.unpackbits(bitmask.astype("<i4", copy=False).view(np.uint8), bitorder="little"))
        allowed = allowed[(allowed < tokenizer.vocab_size) & (allowed != tokenizer.eos_token)]
        if not len(allowed):
            return None
        matcher.consume_token(int(allowed[0]))
        if matcher.is_error():
            return f"after {step + 1} tokens: {_reason(matcher)}"
    return None


@dataclass(frozen=True)
class GrammarProcessor(LogitsProcessor):
    """A grammar bound to a tokenizer. State: {"slot": int64 [rows], "pool": a 0-dim tensor}. The rows'
    matchers ride on the pool tensor (`pool.matchers`): shared by every row, it lives as long as the state."""

    name: ClassVar[str] = "grammar"
    constraint: Constraint = option("the constraint this runs (a grammar, or a JSON schema as llguidance reads it)")
    tokenizer: Any = option("llguidance's view of the model's tokenizer")
    eos_token_ids: torch.Tensor = option("the end-of-sequence tokens")
    start: Any = option("a matcher at the grammar's start, parsed once at bind: each row begins as a copy")
    step_limit_s: float = option("the most time a generation's grammars may take in one step, in seconds "
                                 "(`set_step_limit_s`)",
                                 default=DEFAULT_STEP_LIMIT_S)

    def init(self, context):
        rows = context.sequence.shape[0]
        pool = torch.tensor(0)
        pool.matchers = [self.start.deep_copy() for _ in range(rows)]
        return {"slot": torch.arange(rows, device=context.sequence.device), "pool": pool}

    @functools.cached_property
    def _own_end(self) -> int | None:
        """llguidance's end-of-sequence token (the model's) when the request's `eos_token_ids` leave it out:
        to the request it is text, which a complete match must not go on writing."""
        end = self.tokenizer.eos_token
        return None if end in self._eos_columns else end

    @functools.cached_property
    def _eos_columns(self) -> np.ndarray:
        """The end-of-sequence tokens as numpy indices, for the biases: read once, not at every step."""
        return self.eos_token_ids.cpu().numpy()

    def process(self, state, logits, context):
        with rust_panics_as(InvalidInput, f"{self.constraint.name}: the parser failed"), _collections_counted():
            return self._process(state, logits, context)

    def _process(self, state, logits, context):
        import llguidance.numpy as llg

        # this thread's CPU time, and the wall time of the masks llguidance's threads make meanwhile: the step's
        # own work, not a compile another thread runs, nor a wait for the GIL or for a busy machine's cores, nor
        # a garbage collection that happens to run in it
        started, waited, collected = time.thread_time(), 0.0, _collector.spent
        pool = state["pool"]
        matchers = pool.matchers
        slots = state["slot"].tolist()
        if context.length > context.input_length:
            last = context.sequence[:, context.length - 1].tolist()
            taken, rows = set(), []
            for slot in slots:
                matcher = matchers[slot]
                rows.append(matcher.deep_copy() if slot in taken else matcher)
                taken.add(slot)
            for matcher, token in zip(rows, last):
                if not matcher.is_stopped():
                    matcher.consume_token(token)
            pool.matchers = matchers = rows
            state = {"slot": torch.arange(len(rows), device=logits.device), "pool": pool}
        else:
            matchers = [matchers[slot] for slot in slots]
        bitmask = llg.allocate_token_bitmask(len(matchers), self.tokenizer.vocab_size)
        if 1 < len(matchers) == len({id(m) for m in matchers}):
            waited = time.perf_counter()
            llg.fill_next_token_bitmask_par(_executor(), list(zip(matchers, range(len(matchers)))), bitmask)
            waited = time.perf_counter() - waited
        else:  # one row, or rows sharing a matcher (no consume since a reorder): never one matcher on two threads
            for row, matcher in enumerate(matchers):
                llg.fill_next_token_bitmask(matcher, bitmask, row)
        self._check_time(time.thread_time() - started + waited - (_collector.spent - collected), len(matchers), context)
        ends = np.empty(len(matchers), dtype=bool)  # rows that may end here
        for row, matcher in enumerate(matchers):
            ends[row] = matcher.is_accepting() or matcher.is_stopped()
            if matcher.is_error():  # its parser gave up (a limit of llguidance's): no text it allows is known
                raise InvalidInput(f"{self.constraint.name}: the parser of row {row} stopped after {context.length - context.input_length} "
                                   f"tokens: {_reason(matcher)}")
        if not ends.all():
            self._check_end_tokens_as_text(matchers, bitmask, ends, context)
        # token i is bit i % 32 of word i // 32: each byte of the little-endian words looked up as its 8
        # tokens' biases (a third of the cost of unpacking the bits and masked_fill, 25 against 80 us at 32k)
        bias = np.take(_BYTE_BIASES, bitmask.astype("<i4", copy=False).view(np.uint8), axis=0)
        bias = bias.reshape(len(matchers), -1)[:, :logits.shape[1]]
        bias[:, self._eos_columns] = np.where(ends, np.float32(0), np.float32(NEG_INF))[:, None]
        if self._own_end is not None:  # where a row may end, llguidance's mask allows its own end there too
            bias[ends, self._own_end] = NEG_INF
        logits = torch.from_numpy(bias).to(logits.device, logits.dtype).add_(logits)
        stuck = logits.amax(dim=1) == NEG_INF
        if bool(stuck.any()):
            logits[stuck.nonzero()[:, :1], self.eos_token_ids] = 0.0
        return state, logits

    def _check_time(self, spent_s: float, rows: int, context) -> None:
        """Adds this step's time to what the chain's other grammars took in this step, and raises past the limit."""
        if getattr(_step, "context", _gone)() is not context:  # a weak reference: the step's tensors are not kept
            _step.context, _step.spent = weakref.ref(context), 0.0
        _step.spent += spent_s
        if _step.spent > self.step_limit_s:
            # in tenths of a millisecond, rounded up: what it took is over the limit as said
            limit_ms, spent_ms = self.step_limit_s * 1e3, math.ceil(_step.spent * 1e4) / 10
            others = "" if spent_s == _step.spent else ", with the grammars before it in the chain"
            raise GrammarStepTooSlow(
                f"{self.constraint.name}: the step of its parser after {context.length - context.input_length} tokens "
                f"took {spent_ms:g} ms for {rows} row{'s' if rows > 1 else ''}{others}, more than the limit of "
                f"{limit_ms:g} ms (limit grammar_step_ms), which other generations would wait for: a grammar that "
                f"reads a text in many ways (as `s: s s`) takes longer at every token; write it so that it reads "
                f"each text one way", value=spent_ms, maximum=limit_ms)

    def _check_end_tokens_as_text(self, matchers, bitmask: np.ndarray, ends: np.ndarray, context) -> None:
        """A grammar may write an end-of-sequence token as text (`<[2]>`, a token class that holds it). Where
        it is not at an end, the token is masked like any end-of-sequence token, since writing one ends the
        generation; where it is all the grammar allows, the text would end there short of a match, which
        is refused, typed, unless writing it completes the grammar (`"a" <[2]>`: an end either way)."""
        eos = self._eos_columns
        written = (bitmask[:, eos // 32] >> (eos % 32)) & 1  # [rows, eos]: the grammar allows it as text
        for row in np.flatnonzero(~ends & written.any(axis=1)).tolist():
            others = bitmask[row].copy()
            np.bitwise_and.at(others, eos // 32, ~(1 << (eos % 32)).astype(others.dtype))  # two may share a word
            if others.any():
                continue  # the text goes on by another token: the end-of-sequence token is masked
            matcher, allowed = matchers[row], eos[written[row] == 1].tolist()
            for token in allowed:
                after = matcher.deep_copy()
                after.consume_token(token)
                if after.is_accepting() or after.is_stopped():
                    ends[row] = True
                    break
            if not ends[row]:
                raise InvalidInput(
                    f"{self.constraint.name}: after {context.length - context.input_length} tokens of row {row} the grammar "
                    f"allows only {', '.join(map(str, allowed))} of eos_token_ids, whose writing ends the text "
                    f"short of a match: a grammar cannot write an end-of-sequence token before its end (send "
                    f"eos_token_ids without it to let the grammar write it as text)")


@functools.cache
def _executor():
    """llguidance's thread pool for the masks of several rows, made at the first need."""
    import llguidance

    return llguidance.LLExecutor()


def _on_deep_stack(work):
    """`work()` on a thread of its own with `GRAMMAR_STACK_BYTES` of stack: its value, or what it raised."""
    outcome = {}

    def run():
        try:
            outcome["value"] = work()
        except BaseException as error:  # a Rust panic too: the caller says what failed
            outcome["error"] = error

    with _stack_size_lock:
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-build")
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _matcher(tokenizer, grammar: str):
    """An llguidance matcher of a grammar in its own format, quiet: what goes wrong is raised, not printed."""
    import llguidance

    return llguidance.LLMatcher(tokenizer, grammar, log_level=0)


def _reason(matcher) -> str:
    """The first line of a failed matcher's error (the rest is a dump of its parser's state)."""
    return matcher.get_error().strip().split("\n")[0][:200]
