"""Attention read in parts (a shared prefix's chain, then each row's own keys) against one SDPA call over
all the keys concatenated, as a cold run computes it."""

import pytest
import torch
import torch.nn.functional as F

from sidecar.attention import _attend, _attend_plain, _decode_after_prefix


class Part:
    """What `_decode_after_prefix` reads of a cache in a chain: its key and value buffers."""

    def __init__(self, keys, values):
        self.keys, self.values = [keys], [values]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows, first", [(1, None), (3, None), (4, [0, 45, 60, 80])],
                         ids=["1 row", "3 rows", "4 rows, each reading the prefix from its own window's start"])
def test_parts_merged_by_log_sum_exp_equal_one_softmax_over_all_keys(dtype, tolerance, rows, first):
    """The last row's window starts past the whole prefix (72 tokens), the second row's past its first part."""
    g = torch.Generator().manual_seed(0)
    kv_heads, heads, dim = 2, 4, 16
    chain = []
    for length, capacity in ((40, 50), (7, 9), (25, 25)):  # buffers longer than what is read, as in the store
        chain.append((Part(torch.randn(1, kv_heads, capacity, dim, generator=g).to(dtype),
                           torch.randn(1, kv_heads, capacity, dim, generator=g).to(dtype)), length))
    own_keys = torch.randn(rows, kv_heads, 12, dim, generator=g).to(dtype)[:, :, :5]
    own_values = torch.randn(rows, kv_heads, 12, dim, generator=g).to(dtype)[:, :, :5]
    query = torch.randn(heads, rows, dim, generator=g).to(dtype)
    spans = [(part, 0, n) for part, n in chain]
    out = _decode_after_prefix(spans, 0, query, own_keys, own_values, None, first=None if first is None else torch.tensor(first))
    assert out.shape == (1, rows, heads, dim) and out.dtype == dtype
    for r in range(rows):
        keys = torch.cat([p.keys[0][:, :, :n] for p, n in chain] + [own_keys[r : r + 1]], dim=2)
        values = torch.cat([p.values[0][:, :, :n] for p, n in chain] + [own_values[r : r + 1]], dim=2)
        start = 0 if first is None else min(first[r], 72)  # the own keys: all of them (the lanes' own mask cuts them)
        expected = F.scaled_dot_product_attention(query[:, r : r + 1].transpose(0, 1).unsqueeze(2), keys[:, :, start:],
                                                  values[:, :, start:], enable_gqa=True)  # [1, heads, 1, dim]
        torch.testing.assert_close(out[0, r].float(), expected[0, :, 0].float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "decode group's lanes"])
def test_the_plain_path_other_devices_take_equals_the_fused_kernel(masked):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (4, 30, 30))
    mask = None
    if masked:  # each row sees its own keys only, as the lanes of a decode group continuing a prefix
        seen = torch.arange(30) <= torch.tensor([11, 29])[:, None]
        mask = torch.zeros(2, 1, 1, 30).masked_fill_(~seen[:, None, None, :], float("-inf"))
    fused, plain = _attend(q, k, v, 0.3, mask), _attend_plain(q, k, v, 0.3, mask)
    torch.testing.assert_close(fused[0], plain[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused[1], plain[1], atol=1e-6, rtol=1e-6)
