"""Constraints on the generated text: regular ones compiled to token automata, and a user's own automaton.

    chain = Chain([configure(Regex, pattern=r"\\d{3}-\\d{4}")]).bind(Vocabulary.from_tokenizer(tok), [tok.eos_token_id])
"""

from . import compile, grammar, vocabulary
from .automaton import TokenAutomaton
from .constraints import AutomatonProcessor, Constraint, Dfa
from .grammar import Grammar, GrammarProcessor
from .json_schema import JsonSchema
from .regular import Choice, Regex
from .vocabulary import Vocabulary

__all__ = ["AutomatonProcessor", "Choice", "Constraint", "Dfa", "Grammar", "GrammarProcessor", "JsonSchema", "Regex",
           "TokenAutomaton", "Vocabulary", "forget_vocabulary"]


def forget_vocabulary(fingerprint: str) -> None:
    """Drops what is kept for constraints over the vocabulary of `fingerprint` (`Vocabulary.fingerprint`):
    compiled automata (up to 512 MiB), llguidance's parsers and its view of the vocabulary. For a model
    going away: later constraints over that vocabulary are compiled again. Two smaller tables per
    vocabulary are left to their own bounds: the token walkers of lazily compiled automata (`lazy`, the
    last 4 vocabularies) and the compile fork server's tries."""
    compile.forget(fingerprint)
    grammar.forget(fingerprint)
    vocabulary.forget(fingerprint)
