"""transformers interop: a `Chain` as a `transformers.LogitsProcessor` for `model.generate`, and a transformers
processor as one of ours.

transformers calls a processor with the whole `input_ids` at every step and never says when beam search
reorders or replaces rows. The adapter therefore finds each row's parent among the previous step's rows
by content (the row minus its last token) and reorders the chain's states to match before processing.

Nor does it say when a new `generate` call begins, and content cannot tell: a call whose prompt is the
last call's output (a text continued) looks like that call's next step, and its states would carry the
last call's tokens as generated ones (a frequency penalty on them, `input_length` the old prompt's). So
the adapter also reads which call it is in: `generate` deep-copies its `GenerationConfig` once per call
and hands the copy to its decoding loop, which calls the processors; a step under another copy than the
last step's starts a new generation. Called outside `generate` (no such copy up the stack), content
alone decides.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers import LogitsProcessor as HFLogitsProcessor

from .chain import Chain
from .contract import Context, StatelessProcessor, option


class ChainLogitsProcessor(HFLogitsProcessor):
    def __init__(self, chain: Chain):
        self.chain = chain if isinstance(chain, Chain) else Chain(chain)
        self._previous: torch.Tensor | None = None
        self._states = None
        self._input_length = 0
        self._call = None  # a weak reference to the GenerationConfig of the generate call of the last step

    def _parents(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Row index of each row's parent in the previous call, or None when this is a new generation."""
        previous, call = self._previous, _generate_call()
        last_call, self._call = self._call, None if call is None else weakref.ref(call)
        if call is not None and (last_call is None or last_call() is not call):
            return None
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


def _generate_call(depth: int = 12) -> GenerationConfig | None:
    """The `GenerationConfig` copy of the `generate` call this step runs in, found up the stack (its decoding
    loop holds it as `generation_config`), or None outside one."""
    frame = sys._getframe(2)
    while frame is not None and depth:
        if "generation_config" in frame.f_code.co_varnames:
            config = frame.f_locals.get("generation_config")
            if isinstance(config, GenerationConfig):
                return config
        frame, depth = frame.f_back, depth - 1
    return None


def as_hf_logits_processor(chain) -> ChainLogitsProcessor:
    """Wraps a `Chain` (or a list of processors) for `model.generate(logits_processor=[...])`."""
    return ChainLogitsProcessor(chain)


@dataclass(frozen=True)
class TransformersProcessor(StatelessProcessor):
    """A transformers `LogitsProcessor` (or warper) as one of ours, called as transformers calls it: with every
    token so far of each row (prompt and generated) and the scores, at each step. It keeps no state of ours:
    it reads each row's tokens again, so beams and samples reorder freely. Its rows are the generation's live
    ones: a sample that ended leaves the batch here, where transformers keeps it padded to the end, so one that
    reads its row's position (`PrefixConstrainedLogitsProcessor`'s batch id) or keeps state per row across
    steps (SynthID's watermark) sees another batch than in transformers once a sample ends early."""

    processor: object = option("the transformers processor")

    @property
    def name(self) -> str:  # what errors call it
        return type(self.processor).__name__

    def transform(self, logits, context):
        return self.processor(context.sequence[:, : context.length], logits)


def from_hf_logits_processor(processor: HFLogitsProcessor) -> TransformersProcessor:
    """`processor`, a transformers `LogitsProcessor`, as one of ours (`TransformersProcessor`)."""
    return TransformersProcessor(processor)
