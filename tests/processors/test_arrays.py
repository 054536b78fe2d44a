"""The any-array entry point: torch, numpy, dlpack; 1-D and 2-D; same type and rank back."""

import re

import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf

import processors as P
from processors.arrays import ArrayProcessor


def identity(logits, context):
    return logits


@pytest.mark.parametrize("rank", [1, 2])
def test_numpy_round_trip_without_copy(rank):
    logits = np.random.default_rng(0).standard_normal((4, 300)).astype(np.float32)
    ids = np.arange(8, dtype=np.int32).reshape(4, 2) % 300
    if rank == 1:
        logits, ids = logits[0], ids[0]
    out = ArrayProcessor([identity])(ids, logits)
    assert isinstance(out, np.ndarray) and out.shape == logits.shape
    assert np.shares_memory(out, logits)


@pytest.mark.parametrize("rank", [1, 2])
def test_torch_and_numpy_agree_with_the_chain(rank):
    chain = [P.RepetitionPenalty(1.3), P.TopK(7)]
    logits = torch.randn(2, 100)
    ids = torch.randint(0, 100, (2, 6))
    if rank == 1:
        logits, ids = logits[0], ids[0]
    via_torch = ArrayProcessor(chain)(ids, logits)
    via_numpy = ArrayProcessor(chain)(ids.numpy(), logits.numpy())
    assert isinstance(via_torch, torch.Tensor) and via_torch.dim() == rank
    assert np.array_equal(via_numpy, via_torch.numpy())
    theirs = hf.LogitsProcessorList([hf.RepetitionPenaltyLogitsProcessor(1.3), hf.TopKLogitsWarper(7)])
    expected = theirs(ids.reshape(-1, 6), logits.reshape(-1, 100).clone())
    assert torch.equal(via_torch.reshape(-1, 100), expected)


def test_state_carries_over_steps():
    step = ArrayProcessor([P.FrequencyPenalty(1.0)])
    logits = np.zeros(10, dtype=np.float32)
    step(np.array([1, 2]), logits)
    out = step(np.array([1, 2, 5]), logits)
    out = step(np.array([1, 2, 5, 5]), logits)
    assert out[5] == -2.0 and out[1] == 0.0
    step.reset()
    assert step(np.array([5, 5]), logits)[5] == 0.0


def test_dlpack_input_comes_back_as_its_own_type():
    """numpy's from_dlpack stands in for any array-API library; torch tensors expose __dlpack__ too."""

    class Foreign:
        def __init__(self, array):
            self.array = array

        def __dlpack__(self, **kwargs):
            return self.array.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

        def __array_namespace__(self):
            return np

    logits = np.ones(5, dtype=np.float32)
    out = ArrayProcessor([P.SuppressTokens([2])])(Foreign(np.array([0, 1])), Foreign(logits))
    assert isinstance(out, np.ndarray) and out[2] == -np.inf and out[0] == 1.0


def test_jax_arrays_when_installed():
    jnp = pytest.importorskip("jax.numpy", reason="jax is not installed: the jax path is not exercised")
    logits = jnp.ones((2, 5), dtype=jnp.float32)
    out = ArrayProcessor([P.SuppressTokens([1])])(jnp.zeros((2, 3), dtype=jnp.int32), logits)
    assert type(out) is type(logits) and float(out[0, 1]) == float("-inf")


def test_rejects_what_it_cannot_read():
    with pytest.raises(P.InvalidInput, match="numpy array"):
        ArrayProcessor([identity])([1, 2], [0.5, 0.5])
    for ids in (np.ones(2), np.ones(2, dtype=bool)):  # the shape as given (it was the one made for a row, (1, 2))
        with pytest.raises(P.InvalidInput, match=f"integer array, got shape .2,. of torch.{'float64' if ids.dtype != bool else 'bool'}"):
            ArrayProcessor([identity])(ids, np.ones(5, dtype=np.float32))
    # ranks that differ: "must be 1-D or 2-D" of a 1-D array, or the shape (1, 1, 2) made for a row, before
    for ids, logits in ((np.array([1, 2]), np.ones((2, 5), dtype=np.float32)), (np.array([[1, 2]]), np.ones(5, dtype=np.float32))):
        with pytest.raises(P.InvalidInput, match=rf"must both be 1-D \(one sequence\) or both 2-D \(rows\), got shapes "
                                                 rf"{re.escape(str(ids.shape))} and {re.escape(str(logits.shape))}"):
            ArrayProcessor([identity])(ids, logits)
    # an id past 2**63 wrapped round to a negative one in the message ("token id -1")
    with pytest.raises(P.InvalidInput, match=f"token id {2**64 - 1}, outside the vocabulary of 5"):
        ArrayProcessor([identity])(np.array([1, 2**64 - 1], dtype=np.uint64), np.ones(5, dtype=np.float32))


def test_a_new_sequence_without_reset_is_refused_saying_so():
    processor = ArrayProcessor([P.RepetitionPenalty(2.0)])
    logits = np.ones(6, dtype=np.float32)
    processor(np.array([1, 2, 3]), logits)
    processor(np.array([1, 2, 3, 4]), logits)
    refused = r"does not extend every row of the last call's \(1 of 4\): a new sequence\? call reset\(\) first"
    for other in ([5, 1], [5, 6, 7, 8, 9], [1, 2, 3, 5, 9], [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]):  # shorter, or longer
        with pytest.raises(P.InvalidInput, match=refused):  # but another sequence, or another number of rows
            processor(np.array(other), np.ones((len(other), 6) if isinstance(other[0], list) else 6, dtype=np.float32))
    processor(np.array([1, 2, 3, 4, 5, 5]), logits)  # two tokens on at once: a continuation
    for ids, scores, message in ((np.array([1, 2, 3, 4, 5, 5, 99]), logits, "token id 99, outside the vocabulary of 6"),
                                 (np.array([1, 2, 3, 4, 5, 5, 1]), np.ones((1, 1, 6), dtype=np.float32), "1-D or 2-D"),
                                 (np.array([1, 2, 3, 4, 5, 5, 1]), np.ones(8, dtype=np.float32),
                                  "logits have 8 columns, the last call's 6")):
        with pytest.raises(P.InvalidInput, match=message):
            processor(ids, scores)
    processor.reset()
    assert processor(np.array([5, 1]), logits).tolist() == [1.0, 0.5, 1.0, 1.0, 1.0, 0.5]  # the new sequence's tokens only


def test_a_step_that_failed_may_be_tried_again():
    failures = []

    def flaky(logits, context):
        if failures:
            raise failures.pop()
        return logits

    processor = ArrayProcessor([P.RepetitionPenalty(2.0), flaky])
    logits = np.ones(6, dtype=np.float32)
    processor(np.array([1, 2]), logits)
    failures.append(ValueError("once more"))
    with pytest.raises(ValueError):
        processor(np.array([1, 2, 3]), logits)
    assert processor(np.array([1, 2, 3]), logits).tolist() == [1.0, 0.5, 0.5, 0.5, 1.0, 1.0]
