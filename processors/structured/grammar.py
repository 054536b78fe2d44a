"""`Grammar`: a context-free constraint in Lark syntax, which no finite automaton can express, run by llguidance.

A pushdown constraint has no finite table of states to precompute, so each row keeps an llguidance matcher
(its parser) and the processor's state holds, per row, the index of that row's matcher in a pool shared by
the generation. `Chain.reorder` moves the indices with their beams as it moves any per-row state; two rows
left pointing at one matcher after a reorder get their own copy when they next consume a token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..contract import LogitsProcessor, option
from ..errors import InvalidOption
from .constraints import NEG_INF, Constraint, _pattern, _validate_lark

_BIT = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class Grammar(Constraint):
    """The generated text is one `start` of a context-free grammar in Lark syntax (llguidance's dialect:
    `start: ...` rules, "literals", /regex/ terminals, `%ignore`)."""

    name: ClassVar[str] = "grammar"
    grammar: str = option("the grammar, in Lark syntax, whose `start` rule the whole text must match", check=_pattern)

    def validate(self):
        import llguidance

        ok, problem = _validate_lark(llguidance.LLMatcher.grammar_from_lark(self.grammar))
        if not ok:
            raise InvalidOption(f"option 'grammar' is not a valid Lark grammar: {problem}")

    def bind(self, vocabulary, eos_token_ids, device="cpu", after_others=True):
        eos = self.end_tokens(eos_token_ids)
        return GrammarProcessor(self, vocabulary.llguidance_tokenizer(),
                                torch.tensor(eos, dtype=torch.long, device=device))


@dataclass(frozen=True)
class GrammarProcessor(LogitsProcessor):
    """A grammar bound to a tokenizer. State: {"slot": int64 [rows], "pool": a 0-dim tensor}. The rows'
    matchers ride on the pool tensor (`pool.matchers`): shared by every row, it lives as long as the state."""

    name: ClassVar[str] = "grammar"
    constraint: Grammar = option("the grammar this runs")
    tokenizer: Any = option("llguidance's view of the model's tokenizer")
    eos_token_ids: torch.Tensor = option("the end-of-sequence tokens")

    def init(self, context):
        import llguidance

        rows = context.sequence.shape[0]
        text = llguidance.LLMatcher.grammar_from_lark(self.constraint.grammar)
        pool = torch.tensor(0)
        pool.matchers = [llguidance.LLMatcher(self.tokenizer, text) for _ in range(rows)]
        return {"slot": torch.arange(rows, device=context.sequence.device), "pool": pool}

    def process(self, state, logits, context):
        import llguidance.torch as llg

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
                if not matcher.is_stopped() and not matcher.is_error():
                    matcher.consume_token(token)
            pool.matchers = matchers = rows
            state = {"slot": torch.arange(len(rows), device=logits.device), "pool": pool}
        else:
            matchers = [matchers[slot] for slot in slots]
        width = logits.shape[1]
        bitmask = llg.allocate_token_bitmask(len(matchers), self.tokenizer.vocab_size)
        for row, matcher in enumerate(matchers):
            llg.fill_next_token_bitmask(matcher, bitmask, row)
        allowed = ((bitmask.unsqueeze(-1) >> _BIT) & 1).bool().view(len(matchers), -1)[:, :width].to(logits.device)
        ends = torch.tensor([m.is_accepting() or m.is_error() or m.is_stopped() for m in matchers], device=logits.device)
        allowed[:, self.eos_token_ids] = ends.unsqueeze(1)
        logits = logits.masked_fill(~allowed, NEG_INF)
        stuck = logits.amax(dim=1) == NEG_INF
        if bool(stuck.any()):
            logits[stuck.nonzero()[:, :1], self.eos_token_ids] = 0.0
        return state, logits
