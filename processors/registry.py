"""Built-in processors by name: how the protocol and the Elixir client refer to them."""

from __future__ import annotations

from .contract import LogitsProcessor, configure, describe
from .errors import InvalidOption
from .penalties import FrequencyPenalty, NoRepeatNGram, PresencePenalty, RepetitionPenalty
from .sampling import EpsilonCutoff, EtaCutoff, MinP, Temperature, TopH, TopK, TopP, TypicalP
from .structured import Choice, Dfa, Grammar, JsonSchema, Regex
from .tokens import (
    ForcedBOS,
    ForcedEOS,
    MinLength,
    MinNewTokens,
    NoBadWords,
    SequenceBias,
    SuppressTokens,
    SuppressTokensAtBegin,
)

BUILTINS: dict[str, type[LogitsProcessor]] = {
    cls.name: cls
    for cls in (
        Temperature, TopH, TopK, TopP, MinP, TypicalP, EpsilonCutoff, EtaCutoff,
        RepetitionPenalty, FrequencyPenalty, PresencePenalty, NoRepeatNGram,
        MinLength, MinNewTokens, SuppressTokens, SuppressTokensAtBegin, ForcedBOS, ForcedEOS,
        SequenceBias, NoBadWords,
        Regex, Choice, JsonSchema, Grammar, Dfa,
    )
}


def from_name(name: str, options: dict | None = None) -> LogitsProcessor:
    """Configures the built-in called `name`; an unknown name is rejected with the list of known ones."""
    if not isinstance(name, str):
        raise InvalidOption(f"a processor name is a string, got {type(name).__name__}")
    if options is not None and not (isinstance(options, dict) and all(isinstance(k, str) for k in options)):
        raise InvalidOption("processor options are a map with string keys")
    cls = BUILTINS.get(name)
    if cls is None:
        raise InvalidOption(f"unknown processor {name[:64]!r}; known processors: {', '.join(sorted(BUILTINS))}")
    return configure(cls, **(options or {}))


def catalogue() -> dict[str, list[dict]]:
    """Every built-in with its declared options, for `hello` and for generated docs."""
    return {name: describe(cls) for name, cls in BUILTINS.items()}
