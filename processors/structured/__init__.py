"""Constraints on the generated text: regular ones compiled to token automata, and a user's own automaton.

    chain = Chain([configure(Regex, pattern=r"\\d{3}-\\d{4}")]).bind(Vocabulary.from_tokenizer(tok), [tok.eos_token_id])
"""

from .automaton import TokenAutomaton
from .constraints import AutomatonProcessor, Choice, Constraint, Dfa, Regex
from .grammar import Grammar, GrammarProcessor
from .json_schema import JsonSchema
from .vocabulary import Vocabulary

__all__ = ["AutomatonProcessor", "Choice", "Constraint", "Dfa", "Grammar", "GrammarProcessor", "JsonSchema", "Regex", "TokenAutomaton", "Vocabulary"]
