"""A model is served only if the engine's forward passes give transformers' logits for it.

The engine runs a model with its own attention (`attention.rows_attention`) and its own positions, which
reproduce transformers' computation only for models that take their keys, values and positions the way
the attention interface hands them over. A model that does otherwise gave other tokens, silently (found
from outside: DiffLlama calls the attention twice a layer with two halves of its values, and the cache
kept the second; Blenderbot's learned positions count from transformers' cache, which the engine does not
use). So at load, a short sequence goes through the engine's paths (a first chunk, a chunk after it, one
decode step beside another cache's chunk, in one pass) and through the model as transformers runs it,
without a cache; a model whose logits differ by more than its dtype's rounding is refused.

The difference is measured as the error of each position's logits relative to their spread (the norm
of the logits less their mean, which softmax ignores): rounding makes it grow with depth in half
precision (measured on random Llamas in bfloat16: 0.7% at 2 layers, 9-13% at 24-64; float16 under 2%),
while a model computed otherwise gives 50% and more (DiffLlama 91%, Blenderbot 141%, in any dtype).
"""

from __future__ import annotations

import torch

from . import models
from .attention import Plan, Segment
from .decode import forward
from .errors import InvalidModel

TOKENS = 12  # the sequence checked: chunks of 7 and 4, then one decode step
TOLERANCE = {torch.float32: 0.002, torch.float64: 0.002}  # relative error of a position's logits (see above)
HALF_TOLERANCE = 0.5  # float16, bfloat16: rounding alone reaches 13% in a deep model


def check(model, store, windows) -> None:
    """Raises `InvalidModel` unless the engine's paths give the logits of transformers' uncached forward pass,
    up to the dtype's rounding. Its caches are the store's, released before it returns."""
    vocab_size = models.vocab_size(model)
    context = getattr(model.config, "max_position_embeddings", None) or TOKENS
    tokens = min(TOKENS, context)
    if tokens < 4:
        return
    ids = [(7919 * i + 104729) % vocab_size for i in range(1, tokens + 1)]
    try:  # a mask given: transformers warns of padding (GPT-2's pad id may be among the ids) without one
        with torch.inference_mode():
            given = torch.tensor([ids], device=model.device)
            reference = model(input_ids=given, attention_mask=torch.ones_like(given), use_cache=False).logits[0].float()
            reference = torch.cat([reference, reference[:4]])  # the second cache's chunk: the first four again
            ours = _engine_logits(model, store, windows, ids)
    except Exception as error:  # its code assumes what the engine's attention does not give (a shape, a layout)
        raise failed(model, error) from error
    if not bool(reference.isfinite().all()):  # a half-precision model that overflows: its generations say so
        return
    spread = reference - reference.mean(dim=-1, keepdim=True)
    error = (ours - ours.mean(dim=-1, keepdim=True) - spread).norm(dim=-1) / spread.norm(dim=-1).clamp(min=1e-30)
    worst, allowed = float(error.max()), TOLERANCE.get(model.dtype, HALF_TOLERANCE)
    if not worst <= allowed:  # NaN fails too
        raise InvalidModel(
            f"{type(model).__name__} computes other logits in the batched engine than in transformers (off by "
            f"{worst:.1%} of their spread, where {model.dtype} rounding allows {allowed:.1%}): "
            "its attention or positions do not go through transformers' attention interface as the engine runs it, "
            "and its tokens would not be transformers'")


def reads_config_window(model) -> bool:
    """Whether the model's own forward pass reads `config.sliding_window`, the window the engine gives the layers
    whose attention is told none (`attention.layer_windows`: Qwen2-MoE and PhiMoE apply theirs through the
    mask alone). Some configs carry one the model never applies (Moshi's): its logits over a short sequence
    are the same under a window of 2 tokens and one of a million, and the engine then applies none either
    (it cut their context to the window, silently: the check's short sequence is within any real window)."""
    ids = torch.arange(TOKENS, device=model.device).remainder(models.vocab_size(model))[None]
    saved, config = model.config.sliding_window, model.config
    passes = []
    try:
        with torch.inference_mode():
            for window in (2, 10**6):
                config.sliding_window = window
                passes.append(model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits)
    except Exception as error:
        raise failed(model, error) from error
    finally:
        config.sliding_window = saved
    return not torch.equal(*passes)


def failed(model, error: Exception) -> InvalidModel:
    """The refusal of a model whose forward pass raised `error` in the engine."""
    return InvalidModel(f"{type(model).__name__} cannot run in the batched engine: its forward pass failed with "
                        f"{type(error).__name__}: {str(error)[:300]}")


def _engine_logits(model, store, windows, ids: list[int]) -> torch.Tensor:
    """The logits of every position of `ids`, then of its first four again, from the engine's paths:
    `ids[:first]` as one chunk from position 0, the rest but the last as a chunk after it (a masked
    attention over the cache), then the last as a decode step, in one pass with a second cache's chunk
    of the first four tokens (a batch of two segments)."""
    first, last = 7 * len(ids) // 12, len(ids) - 1
    main, other, peak = store.cache(), store.cache(), store.peak_bytes
    try:
        for cache in (main, other):
            cache.reserve(len(ids))
        parts = []
        for start, end in ((0, first), (first, last)):
            plan = Plan([Segment(main, 0, start, end - start)], windows)
            parts.append(forward(model, ids[start:end], list(range(start, end)), plan, list(range(end - start))))
            main.length = end
        plan = Plan([Segment(main, 0, last, 1), Segment(other, 0, 0, 4)], windows)
        both = forward(model, [ids[last], *ids[:4]], [last, 0, 1, 2, 3], plan, list(range(5)))
        return torch.cat([*parts, both])
    finally:  # no trace in the store: its peak is the generations'
        store.release(main)
        store.release(other)
        store.peak_bytes = peak
