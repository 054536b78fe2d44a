"""Each generated token's log-probability under the model, and the most likely tokens of its step.

The model's distribution, before any processor: the log-softmax of its logits, as transformers'
`generate(output_logits=True)` returns them and vLLM's `logprobs` reports them by default, so a
temperature, a top-k or a constraint changes which token is drawn but not what the model gave it. A step's
record is `[logprob of the token, k ids, their k logprobs]` as float64 (exact for an id), a row's records
kept one after another in an `array("d")`: 8 bytes a value, where a list of Python floats takes 32.
"""

from __future__ import annotations

import torch


def top_of(log_probs: torch.Tensor, k: int):
    """Each row's k most likely (most likely first), or None for k = 0; k past the vocabulary is all of it."""
    return log_probs.topk(min(k, log_probs.shape[-1]), dim=-1) if k else None


def records(log_probs: torch.Tensor, tokens: torch.Tensor, top, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[n, 1 + 2k] float64: the log-probability of each token, then its row's k most likely ids and theirs
    (`top`, from `top_of`). `log_probs` [rows, vocab] is the model's log-softmax; token i is of row
    `rows[i]` (beam candidates continue any running beam), or of row i."""
    rows = torch.arange(len(tokens), device=tokens.device) if rows is None else rows
    chosen = log_probs[rows, tokens].double()[:, None]
    if top is None:
        return chosen
    return torch.cat([chosen, top.indices.index_select(0, rows).double(), top.values.index_select(0, rows).double()], dim=1)


def unpacked(records, tokens: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The records of `tokens` steps, one after another, into (each token's log-probability, each step's most
    likely (id, logprob) pairs)."""
    width = len(records) // tokens if tokens else 1
    k = (width - 1) // 2
    steps = [records[i : i + width] for i in range(0, len(records), width)]
    return [step[0] for step in steps], [list(zip(map(int, step[1 : 1 + k]), step[1 + k :])) for step in steps]
