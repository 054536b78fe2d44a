"""One entry point for any array library: torch, numpy, or anything with `__dlpack__` (outlines #998).

`ArrayProcessor(chain)(input_ids, logits)` takes 1-D (one row) or 2-D inputs, converts them to torch
without copying where numpy or dlpack allows, runs one step, and returns the logits in the type and rank
it was given. It keeps the chain's states between calls, so it fits a generation loop that calls it once
per step with the growing `input_ids`.
"""

from __future__ import annotations

import numpy as np
import torch

from .chain import Chain, check_token_ids
from .contract import Context
from .errors import InvalidInput


def to_torch(array) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(array))
    if hasattr(array, "__dlpack__"):
        return torch.from_dlpack(array)
    raise InvalidInput(f"expected a torch tensor, a numpy array or a __dlpack__ array, got {type(array).__name__}")


def from_torch(tensor: torch.Tensor, like):
    """`tensor` as the array type of `like`: the same object kind the caller passed in."""
    if isinstance(like, torch.Tensor):
        return tensor
    if isinstance(like, np.ndarray):
        return tensor.numpy()
    return like.__array_namespace__().from_dlpack(tensor)


class ArrayProcessor:
    """Drives a `Chain` (or a list of processors) step by step on arrays of any library."""

    def __init__(self, chain, *, input_length: int | None = None):
        self.chain = chain if isinstance(chain, Chain) else Chain(chain)
        self.input_length = input_length
        self.states = None

    def reset(self) -> None:
        """Forgets the states: the next call starts a new sequence."""
        self.states = None

    def __call__(self, input_ids, logits):
        ids, scores = to_torch(input_ids), to_torch(logits)
        rank = scores.dim()
        if rank not in (1, 2):
            raise InvalidInput(f"logits must be a 1-D or 2-D array, got shape {tuple(scores.shape)}")
        if ids.dim() not in (1, 2) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InvalidInput(f"input_ids must be a 1-D or 2-D integer array, got shape {tuple(ids.shape)} of {ids.dtype}")
        if ids.dim() != rank:
            raise InvalidInput(f"input_ids and logits must both be 1-D (one sequence) or both 2-D (rows), got shapes "
                               f"{tuple(ids.shape)} and {tuple(scores.shape)}")
        if rank == 1:
            ids, scores = ids.unsqueeze(0), scores.unsqueeze(0)
        if ids.dtype != torch.long:
            unsigned = ids.dtype == getattr(torch, "uint64", None)
            ids = ids.long()
            if unsigned and bool((ids < 0).any()):  # past 2**63, wrapped round by the conversion
                raise InvalidInput(f"input_ids holds token id {int(ids[ids < 0][0]) + 2**64}, outside the vocabulary "
                                   f"of {scores.shape[-1]}")
        starting = self.states is None
        if starting:
            self._prompt_length = ids.shape[1] if self.input_length is None else self.input_length
        elif scores.shape[-1] != self._vocab_size:
            raise InvalidInput(f"logits have {scores.shape[-1]} columns, the last call's {self._vocab_size}: a new "
                               "sequence of another model? call reset() first")
        elif not (ids.shape[0] == self._ids.shape[0] and ids.shape[1] > self._ids.shape[1]
                  and torch.equal(ids[:, : self._ids.shape[1]], self._ids)):
            raise InvalidInput(f"input_ids ({ids.shape[0]} rows of {ids.shape[1]} tokens) does not extend every row of "
                               f"the last call's ({self._ids.shape[0]} of {self._ids.shape[1]}): a new sequence? call "
                               "reset() first (rows reordered, as in beam search? drive the Chain, with reorder)")
        context = Context(ids, ids.shape[1], self._prompt_length, scores.shape[-1])
        if not starting:  # `init` checks a new sequence's tokens; these are the ones added since the last call
            check_token_ids(context, self._ids.shape[1])
        states = self.chain.init(context) if starting else self.states
        self.states, out = self.chain.process(states, scores, context)
        self._ids, self._vocab_size = ids.clone(), scores.shape[-1]  # once the step held: a failed one may be tried again
        return from_torch(out[0] if rank == 1 else out, logits)
