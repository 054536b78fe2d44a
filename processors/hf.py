"""transformers interop: a `Chain` as a `transformers.LogitsProcessor` for `model.generate`.

transformers calls a processor with the whole `input_ids` at every step and never says when beam search
reorders or replaces rows. The adapter therefore finds each row's parent among the previous step's rows
by content (the row minus its last token) and reorders the chain's states to match before processing.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor as HFLogitsProcessor

from .chain import Chain
from .contract import Context


class ChainLogitsProcessor(HFLogitsProcessor):
    def __init__(self, chain: Chain):
        self.chain = chain if isinstance(chain, Chain) else Chain(chain)
        self._previous: torch.Tensor | None = None
        self._states = None
        self._input_length = 0

    def _parents(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Row index of each row's parent in the previous call, or None when this is a new generation."""
        previous = self._previous
        if previous is None or previous.shape[1] + 1 != input_ids.shape[1]:
            return None
        same = (input_ids[:, None, :-1] == previous[None, :, :]).all(dim=-1)
        found = same.any(dim=1)
        if not bool(found.all()):
            return None
        return same.to(torch.uint8).argmax(dim=1)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        parents = self._parents(input_ids)
        if parents is None:
            self._input_length = input_ids.shape[1]
        context = Context(input_ids, input_ids.shape[1], self._input_length, scores.shape[-1])
        if parents is None:
            states = self.chain.init(context)
        else:
            states = self.chain.reorder(self._states, parents)
        self._states, scores = self.chain.process(states, scores, context)
        self._previous = input_ids
        return scores


def as_hf_logits_processor(chain) -> ChainLogitsProcessor:
    """Wraps a `Chain` (or a list of processors) for `model.generate(logits_processor=[...])`."""
    return ChainLogitsProcessor(chain)
