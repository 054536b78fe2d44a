"""Logits processors with Bumblebee's contract, in torch.

    chain = Chain([configure(TopK, k=50), configure(TopP, p=0.9)])
    states = chain.init(context)
    states, logits = chain.process(states, logits, context)
"""

from .arrays import ArrayProcessor
from .chain import Chain
from .contract import Context, FunctionProcessor, LogitsProcessor, StatelessProcessor, configure, describe, option
from .errors import InvalidInput, InvalidOption, OverLimit, ProcessorError
from .penalties import FrequencyPenalty, NoRepeatNGram, PresencePenalty, RepetitionPenalty
from .registry import BUILTINS, catalogue, from_name
from .sampling import EpsilonCutoff, EtaCutoff, MinP, Temperature, TopH, TopK, TopP, TypicalP
from .structured import Choice, Dfa, Grammar, JsonSchema, Regex, Vocabulary
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

__all__ = [
    "ArrayProcessor", "BUILTINS", "Chain", "Choice", "Context", "Dfa", "EpsilonCutoff", "EtaCutoff", "ForcedBOS", "ForcedEOS",
    "FrequencyPenalty", "FunctionProcessor", "Grammar", "InvalidInput", "InvalidOption", "JsonSchema",
    "LogitsProcessor", "MinLength", "MinNewTokens", "MinP", "NoBadWords", "NoRepeatNGram", "OverLimit",
    "PresencePenalty", "ProcessorError", "Regex", "RepetitionPenalty", "SequenceBias", "StatelessProcessor",
    "SuppressTokens", "SuppressTokensAtBegin", "Temperature", "TopH", "TopK", "TopP", "TypicalP", "Vocabulary", "catalogue",
    "configure", "describe", "from_name", "option",
]
