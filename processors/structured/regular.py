"""Regular constraints, `Regex` and `Choice` (and `JsonSchema`, whose module adds its schema checks):
compiled from one regex by outlines-core into a token automaton, or, over a vocabulary where the
automaton's masks could not be reserved, run by llguidance on the same regex.

Over a vocabulary that writes every byte an automaton is compiled lazily, and its masks are reserved,
a float32 row of the vocabulary per state, against `build.MAX_MASK_BYTES`: 256 MiB holds about 500 states
over Llama 3's 128k tokens. Past that it would be compiled ahead, every state's tokens walked at once,
which took 8.6 s and 369 MB for the benchmark's JSON schema (1,330 states) over a 128k BPE, and ran past
the 10 s compile timeout for `[a-z]{1,20}( [a-z]{1,20}){0,30}\\.`. The compile says so instead
(`build.MasksTooLarge`, remembered like a failure) and llguidance runs the constraint: its parser over
the vocabulary is built once per vocabulary (1.4 s over 128k tokens), then in milliseconds per
constraint, for a step of 0.6 against 0.2 ms a row.

outlines-core's compile takes time quadratic in the states of the automaton, which a long pattern has
many of: a literal of 5,000 characters took 0.7 s, 10,000 took 2.6 s, 30,000 past its 10 s timeout (and
the limit max_pattern_chars allows 100,000, or a `Choice` of thousands of names). A pattern longer than
`LONG_PATTERN_CHARS` is run by llguidance from the start, whose lexer is made as generation reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..contract import option
from ..errors import InvalidOption
from .anchors import unanchored
from .automaton import TokenAutomaton
from .build import MasksTooLarge
from .compile import compile_regex, is_compiled, masks_too_large
from .constraints import Constraint, _check_syntax, _choices, _compile_timeout, _pattern, escape
from .grammar import RunByLlguidance, check_grammar
from .lazy import LazyAutomaton


LONG_PATTERN_CHARS = 4096  # a regex longer than this is run by llguidance (outlines-core: about 0.5 s at most)


class RegularConstraint(RunByLlguidance, Constraint):
    """A constraint that is a regular language: compiled from one regex by outlines-core, or run by
    llguidance where its masks could not be reserved (see the module)."""

    option_name: ClassVar[str]  # the option the regex is made of, named by llguidance's refusal

    def source(self) -> tuple[str, str]:
        """("regex", pattern) or ("json_schema", schema text): what the compiler is given."""
        raise NotImplementedError

    @property
    def llguidance_grammar(self) -> str:
        """The regex of `source` in llguidance's format."""
        import llguidance

        return llguidance.LLMatcher.grammar_from_regex(self.source()[1])

    def check_grammar(self) -> None:
        """llguidance's check of what it runs (remembered per text)."""
        ok, problem = check_grammar(lambda: self.llguidance_grammar, self.option_name)
        if not ok:
            raise InvalidOption(f"option {self.option_name!r} cannot be enforced: {problem[:300]} (it is run by "
                                f"llguidance, since {self.run_by_llguidance_because})")

    @property
    def run_by_llguidance_because(self) -> str:
        """Why llguidance runs it, as `check_grammar`'s refusal says."""
        if self.long:
            return f"its pattern is longer than {LONG_PATTERN_CHARS} characters, too long to compile an automaton of in time"
        return "its automaton's masks over this vocabulary would take too much memory"

    @property
    def long(self) -> bool:
        """Whether its regex is longer than `LONG_PATTERN_CHARS`: run by llguidance (see the module)."""
        kind, text = self.source()
        return kind == "regex" and len(text) > LONG_PATTERN_CHARS

    def automaton(self, vocabulary, cancelled=None):
        """Compiled (or from the cache); `cancelled`, a callable asked while compiling, may stop it (see
        `compile_regex`)."""
        return compile_regex(self.source(), vocabulary, self.compile_timeout_s, cancelled)

    def compiled_for(self, vocabulary) -> bool:
        """No compiling when an earlier call compiled the same constraint, or failed to with a timeout at
        least this one's; when its masks were found too large, when llguidance's parser is built."""
        if self.long or masks_too_large(self.source(), vocabulary):
            return RunByLlguidance.compiled_for(self, vocabulary)
        return is_compiled(self.source(), vocabulary, self.compile_timeout_s)

    def compile_key(self):
        if self.long:
            return RunByLlguidance.compile_key(self)
        return (self.source(), self.compile_timeout_s)  # a request never waits on a compile bounded by another's

    def compile(self, vocabulary, cancelled=None):
        """Its automaton, or llguidance's parser when its pattern is long or its masks are too large."""
        if self.long:
            return RunByLlguidance.compile(self, vocabulary, cancelled)
        try:
            return self.automaton(vocabulary, cancelled)
        except MasksTooLarge:
            return RunByLlguidance.compile(self, vocabulary, cancelled)

    def bind(self, vocabulary, eos_token_ids, device="cpu", after_others=True, compiled=None):
        if compiled is not None and not isinstance(compiled, (TokenAutomaton, LazyAutomaton)):  # llguidance's
            return RunByLlguidance.bind(self, vocabulary, eos_token_ids, device, after_others, compiled)
        if self.long and compiled is None:
            self.check_grammar()  # remembered per text
            return RunByLlguidance.bind(self, vocabulary, eos_token_ids, device, after_others)
        try:
            return Constraint.bind(self, vocabulary, eos_token_ids, device, after_others, compiled)
        except MasksTooLarge:
            self.check_grammar()  # remembered per text
            return RunByLlguidance.bind(self, vocabulary, eos_token_ids, device, after_others)


@dataclass(frozen=True)
class Regex(RegularConstraint):
    """The generated text matches `pattern` in full (Rust `regex` syntax: no look-around, no back-references)."""

    name: ClassVar[str] = "regex"
    option_name: ClassVar[str] = "pattern"
    pattern: str = option("the regular expression the whole generated text must match", check=_pattern)
    compile_timeout_s: float = _compile_timeout()

    def validate(self):
        unanchored(self.pattern)  # an anchor left inside is refused, by this message rather than the checker's
        _check_syntax(self.pattern, "pattern")

    def source(self):
        return ("regex", unanchored(self.pattern))


@dataclass(frozen=True)
class Choice(RegularConstraint):
    """The generated text is exactly one of `options`."""

    name: ClassVar[str] = "choice"
    option_name: ClassVar[str] = "options"
    options: tuple[str, ...] = option("the texts to choose from", check=_choices)
    compile_timeout_s: float = _compile_timeout()

    def source(self):
        return ("regex", "(" + "|".join(map(escape, self.options)) + ")")
