"""Processors that constrain the generated text: what every constraint does, and a user's own `Dfa`
(`Regex` and `Choice`, `JsonSchema` and `Grammar` have modules of their own).

A constraint is configured with what the user names (a pattern, options, a schema, transitions) and is
checked then. It runs only once bound to a model's vocabulary and end-of-sequence tokens (`bind`, which
the engine calls): binding compiles it into a `TokenAutomaton` and returns an `AutomatonProcessor`. The
state of that processor is one int64 automaton state per row, so `Chain.reorder` moves it with its beam
and `process` is a lookup and a mask, with no loop over rows and no hashing of histories.

Only the generated tokens are constrained (the prompt is not), and the end-of-sequence tokens are allowed
exactly in the states that may end: accepting ones, and any the vocabulary cannot leave.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import checks
from ..contract import Context, LogitsProcessor, option
from ..errors import InvalidOption, ProcessorError
from . import budget
from .automaton import NEG_INF, BoundMasks, TokenAutomaton
from .compile import is_cached
from .vocabulary import Vocabulary

MAX_PATTERN_CHARS = 100_000  # a regex, a schema's JSON or the options of a choice, in characters
MAX_CHOICES = 10_000
MAX_TRANSITIONS = 1_000_000
# A dfa of more transitions than this is made into tables on a compile thread by the server: they take about
# 5 us a transition (0.1 s for the 20,000 a request can carry), where binding it on the main thread paused
# every stream.
DFA_INLINE_TRANSITIONS = 1000


@checks._with_schema({"type": "string", "minLength": 1, "maxLength": MAX_PATTERN_CHARS})
def _pattern(name, value) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidOption(f"option {name!r} must be a non-empty string, got {checks._shown(value)}")
    if len(value) > MAX_PATTERN_CHARS:
        raise InvalidOption(f"option {name!r} has {len(value)} characters, more than the limit of {MAX_PATTERN_CHARS} "
                            f"(limit max_pattern_chars)")
    _check_unicode(name, value)
    return value


def _check_unicode(name: str, text: str) -> None:
    if (at := checks.lone_surrogate(text)) is not None:
        raise InvalidOption(f"option {name!r} is not valid Unicode text: a lone surrogate at index {at}")


@checks._with_schema({"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                       "maxItems": MAX_CHOICES})
def _choices(name, value) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise InvalidOption(f"option {name!r} must be a non-empty list of non-empty strings, got {checks._shown(value)}")
    if len(value) > MAX_CHOICES or sum(map(len, value)) > MAX_PATTERN_CHARS:
        raise InvalidOption(f"option {name!r} is too large: at most {MAX_CHOICES} options of {MAX_PATTERN_CHARS} "
                            f"characters in all (limits max_choices, max_pattern_chars)")
    for index, text in enumerate(value):
        _check_unicode(f"{name}[{index}]", text)
    return tuple(value)


STATE_ID = {"type": "integer", "minimum": 0, "maximum": checks.MAX_TOKEN_ID}


@checks._with_schema({"type": "array", "minItems": 1, "maxItems": MAX_TRANSITIONS,
                       "items": {"type": "array", "items": STATE_ID, "minItems": 3, "maxItems": 3}})
def _transitions(name, value) -> tuple[tuple[int, int, int], ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidOption(f"option {name!r} must be a non-empty list of [state, token_id, next_state] triples")
    if len(value) > MAX_TRANSITIONS:
        raise InvalidOption(f"option {name!r} has {len(value)} transitions, more than the limit of {MAX_TRANSITIONS} "
                            f"(limit max_transitions)")
    out = []
    for triple in value:
        if not (isinstance(triple, (list, tuple)) and len(triple) == 3 and all(checks._is_int(x) and x >= 0 for x in triple)
                and max(triple) <= checks.MAX_TOKEN_ID):
            raise InvalidOption(f"option {name!r}: each transition is [state, token_id, next_state] with integers "
                                f">= 0, got {checks._shown(triple)}")
        out.append(tuple(int(x) for x in triple))
    return tuple(out)


@checks._with_schema({"type": "array", "items": STATE_ID})
def _states(name, value) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(checks._is_int(x) and 0 <= x <= checks.MAX_TOKEN_ID for x in value):
        raise InvalidOption(f"option {name!r} must be a list of states (integers in [0, {checks.MAX_TOKEN_ID}]), "
                            f"got {checks._shown(value)}")
    return tuple(sorted(set(int(x) for x in value)))


class Constraint(LogitsProcessor):
    """A processor that needs the model's vocabulary: configured by the user, compiled by `bind`.

    A kind whose compile can take long says so (`compiled_for`), so that the server compiles it on a thread
    of its own (`compile`) while other sessions go on, then binds what that made (`with_compiled`)."""

    constrains = True

    def automaton(self, vocabulary: Vocabulary) -> TokenAutomaton:
        raise NotImplementedError

    def bind(self, vocabulary: Vocabulary, eos_token_ids, device="cpu", after_others=True,
             compiled=None) -> LogitsProcessor:
        """Bound to `vocabulary`: `compiled`, what `compile` made for it, or compiled now."""
        eos = self.end_tokens(eos_token_ids, vocabulary)
        automaton = compiled if compiled is not None else self.automaton(vocabulary)
        # what binding adds to memory: all of an automaton made for it, only the masks of one the compile
        # cache keeps (it grew as generations reached its states: refusing it would free nothing)
        key, cached = (eos, torch.device(device)), is_cached(automaton)
        made_masks, before = key not in automaton.bound, automaton.reserved_bytes if cached else 0
        masks = automaton.masks(eos, device)
        new_bytes = automaton.reserved_bytes - before
        processor = AutomatonProcessor(self, automaton.to(device), masks,
                                       torch.tensor(eos, dtype=torch.long, device=device), after_others)
        try:
            budget.hold(processor, automaton, new_bytes)
        except budget.ConstraintBudgetExceeded:
            if made_masks:
                automaton.bound.pop(key, None)  # what this binding made goes with it
            raise
        return processor

    def end_tokens(self, eos_token_ids, vocabulary: Vocabulary) -> tuple[int, ...]:
        """The end-of-sequence tokens, sorted: a constrained text cannot end without one, nor with an id
        the logits have no column for."""
        eos = tuple(sorted(set(eos_token_ids)))
        if not eos:
            raise InvalidOption(f"{self.name} needs an end-of-sequence token to end its text, and none is set "
                                f"(eos_token_ids is empty)")
        if eos[0] < 0 or eos[-1] >= vocabulary.size:
            wrong = eos[0] if eos[0] < 0 else eos[-1]
            raise InvalidOption(f"eos_token_ids holds {wrong}, outside the vocabulary of {vocabulary.size} tokens")
        return eos

    def compiled_for(self, vocabulary) -> bool:
        """Whether binding to `vocabulary` takes no compiling worth a thread of its own."""
        return True

    def compile_key(self) -> tuple:
        """What its compile depends on besides the vocabulary: requests with equal keys share one compile."""
        raise NotImplementedError

    def compile(self, vocabulary, cancelled=None):
        """What binding to `vocabulary` needs, made now or found in a cache (`cancelled`, a callable asked
        while compiling, may stop it)."""
        raise NotImplementedError

    def with_compiled(self, vocabulary, compiled) -> "Compiled":
        """This constraint carrying what another thread compiled of it for `vocabulary` (see `Compiled`)."""
        return Compiled(self, vocabulary.fingerprint, compiled)

    def init(self, context: Context):
        raise ProcessorError(f"{self.name} is not bound to a vocabulary: call chain.bind(Vocabulary.from_tokenizer("
                             f"tokenizer), eos_token_ids) first (the engine does it for every generate)")

    process = init


def _compile_timeout():
    return option("the longest compiling may take, in seconds (0, 300]", default=10.0,
                  check=checks.real_in(0.0, 300.0, low_open=True))


@dataclass(frozen=True)
class Compiled(Constraint):
    """A constraint with what a compile thread made of it (the server compiles off its main thread): bound
    to that vocabulary, it takes that. Looking it up again in a compile cache could miss (a compile ending
    meanwhile, or the request's own next constraint, may have evicted it) and compile it a second time on
    the thread that runs every generation."""

    constraint: Constraint = option("the constraint")
    fingerprint: str = option("the fingerprint of the vocabulary it was compiled for")
    compiled: object = option("what `compile` made of the constraint over that vocabulary")

    @property
    def name(self) -> str:
        return self.constraint.name

    def max_token_id(self):
        return self.constraint.max_token_id()

    def bind(self, vocabulary, eos_token_ids, device="cpu", after_others=True, compiled=None):
        if compiled is None and vocabulary.fingerprint == self.fingerprint:
            compiled = self.compiled
        return self.constraint.bind(vocabulary, eos_token_ids, device, after_others, compiled)


@dataclass(frozen=True)
class Dfa(Constraint):
    """A user's own token-level automaton, as the DFA processor built on Bumblebee's stateful processors
    takes it: `(state, token_id, next_state)` triples from `initial_state`. Tokens without a transition
    from the current state are forbidden; end-of-sequence is allowed in `accepting_states` and in states
    with no transition but on end-of-sequence tokens (one on them allows nothing by itself: the text ends)."""

    name: ClassVar[str] = "dfa"
    initial_state: int = option("the state before the first generated token", check=checks.int_at_least(0))
    transitions: tuple[tuple[int, int, int], ...] = option("[state, token_id, next_state] triples", check=_transitions)
    accepting_states: tuple[int, ...] = option("states where the text may end", default=(), check=_states)

    def validate(self):
        """A state no transition names is a typo: as the initial state it would leave every transition
        unreachable, as an accepting one it would never be reached."""
        sources = {source for source, _, _ in self.transitions}
        if self.initial_state not in sources:
            raise InvalidOption(f"option 'initial_state': no transition leaves state {self.initial_state}, so none "
                                f"of the transitions could be taken")
        states = sources | {target for _, _, target in self.transitions}
        unknown = [state for state in self.accepting_states if state not in states]
        if unknown:
            raise InvalidOption(f"option 'accepting_states': state {unknown[0]} is in no transition")

    def max_token_id(self):
        return max(t for _, t, _ in self.transitions)

    def compiled_for(self, vocabulary) -> bool:
        return len(self.transitions) <= DFA_INLINE_TRANSITIONS

    def compile_key(self):
        return ("dfa", id(self))  # never shared: hashing the transitions would cost what making the tables does

    def compile(self, vocabulary, cancelled=None):
        return self.automaton(vocabulary)

    def automaton(self, vocabulary):
        sources, tokens, targets = zip(*self.transitions)
        return TokenAutomaton.from_transitions(self.initial_state, sources, tokens, targets, self.accepting_states,
                                               vocabulary.size)


@dataclass(frozen=True)
class AutomatonProcessor(LogitsProcessor):
    """A constraint bound to a vocabulary: its state is each row's automaton state (int64 [rows])."""

    name: ClassVar[str] = "automaton"
    constraint: Constraint = option("the constraint this runs")
    automaton: TokenAutomaton = option("its compiled tables")
    masks: BoundMasks = option("its masks, end-of-sequence tokens included")
    eos_token_ids: torch.Tensor = option("the end-of-sequence tokens")
    after_others: bool = option("other processors run before it (they may remove every token it allows)")

    def init(self, context):
        return torch.full((context.sequence.shape[0],), self.automaton.initial, dtype=torch.long,
                          device=context.sequence.device)

    def process(self, state, logits, context):
        if state.is_cpu and state.shape[0] == 1:  # one row: Python ints, no per-row tensor ops
            current = int(state)
            if context.length > context.input_length:  # the last token read through numpy: half the cost of torch's
                current = self.automaton.step(current, context.sequence.numpy().item(context.length - 1))
                state = self.automaton.one_row(current)
            bias = self.masks.row(current)  # float32: a conversion costs about a microsecond even when a no-op
            logits = logits + (bias if bias.dtype == logits.dtype else bias.to(logits.dtype))
        else:
            if context.length > context.input_length:
                state = self.automaton.advance(state, context.sequence[:, context.length - 1])
            # (a lazy automaton's masks keep ids from the first row made that allows few tokens)
            if self.masks.kept and state.is_cpu and logits.is_cpu and logits.dtype == torch.float32 \
                    and logits.shape[1] == self.automaton.vocab_size and not logits.requires_grad:
                logits = self.masks.masked(state.numpy(), logits)
            else:  # the gathered rows are a tensor of our own: adding the logits into it saves writing a third
                logits = self.masks.rows(state).to(logits.dtype).add_(logits)
        if self.after_others:
            stuck = logits.amax(dim=1) == NEG_INF  # an earlier processor removed every token this state allows
            if bool(stuck.any()):
                logits[stuck.nonzero()[:, :1], self.eos_token_ids] = 0.0
        return state, logits


_META = set(r"\.+*?()|[]{}^$#&-~")


def escape(text: str) -> str:
    """`text` as a literal in the regex syntax of outlines-core and llguidance (Rust's `regex`)."""
    return "".join("\\" + c if c in _META else c for c in text)


def _check_syntax(pattern: str, name: str) -> None:
    """Rejects a pattern Rust's regex syntax does not accept, at configure time and without a vocabulary."""
    import llguidance

    with rust_panics_as(InvalidOption, f"option {name!r} cannot be checked"):
        ok, problem = _validate_grammar(llguidance.LLMatcher.grammar_from_regex(pattern))
    if not ok:
        raise InvalidOption(f"option {name!r} is not a valid regular expression: {problem}")


@functools.lru_cache(maxsize=64)
def _validate_grammar(grammar: str) -> tuple[bool, str]:
    """llguidance's check of a grammar in its own format: whether it is valid, and its messages. Kept for
    the grammars last asked for: a client sends its constraint with every request, and the check of a
    regex or Lark grammar of `max_pattern_chars` took 63-76 ms, of a JSON schema's grammar 0.56 s."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (not is_error, "; ".join(messages))


@contextlib.contextmanager
def rust_panics_as(kind: type[ProcessorError], what: str):
    """A panic in Rust code (llguidance's: some patterns make its regex simplifier unwrap nothing) comes
    out of pyo3 as `PanicException`, a `BaseException`, which `except Exception` lets through, the
    server's too: it is raised as `kind`, saying `what` failed."""
    try:
        yield
    except BaseException as error:
        if type(error).__module__ != "pyo3_runtime":
            raise
        raise kind(f"{what}: llguidance failed on it ({str(error)[:200]})") from None
