"""The attention function that lets one forward pass serve many sequences with their own caches.

The scheduler calls the model on a flattened batch of one: the new tokens of every row side by side,
`[1, T]`, with their positions, `use_cache=False`, inside `planned(plan)`: a `Plan` saying which slice
of the T tokens belongs to which row of which `KVCache`, starting at which position. transformers hands
every attention layer's fresh keys and values to the function registered for the model's attention
implementation. This one writes each row's keys and values into
its cache and runs the stock SDPA attention of the row's queries against the row's cached keys, with a
causal mask offset by what the row already holds, and within the layer's sliding window if it has one
(the window's keys stay in the cache). A decode step of several rows that share one cache (beams,
samples) is one SDPA call over those rows. A row therefore computes what it computes alone: a lone
session's decode steps are bit-identical to transformers' own `DynamicCache` path (its prefill logits
differ only by the rounding of the output layer's matmul over fewer positions, ~4e-7). Scores SDPA
cannot compute (`Scoring`) are computed in plain ops on every path.

Called without a plan (`model.generate`, a plain forward), it is transformers' SDPA attention (or, with a
`Scoring`, the plain ops'), so the model stays usable as a reference.
"""

from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .kv import DecodeGroup, KVCache, KVStore

NAME = "sidecar_rows"

# The plan of the forward pass running in this thread. Not a keyword of the model's call: some decoder
# layers hand their attention only the arguments they name (Nemotron's), and the plan never reached it.
_plan: ContextVar[Plan | Probe | None] = ContextVar("kv_plan", default=None)


@contextlib.contextmanager
def planned(plan: Plan | Probe):
    """Runs the model's forward passes inside with `plan`: its attention layers serve the plan's rows."""
    token = _plan.set(plan)
    try:
        yield
    finally:
        _plan.reset(token)


@dataclass(frozen=True)
class Segment:
    """Tokens of the batch for one cache: `length` consecutive tokens of row `row` at positions
    `start`... (a prefill chunk or one row's decode step), or, with `rows` > 1, one token for each of
    the cache's rows, all at `start` (the decode step of beams or samples, which share one length)."""

    cache: KVCache
    row: int
    start: int
    length: int
    rows: int = 1

    @property
    def tokens(self) -> int:
        return self.length * self.rows

    @functools.cached_property
    def chain(self) -> list[tuple[KVCache, int]]:
        """What the cache continues (`KVCache.chain`), walked once a forward pass, not once a layer."""
        return self.cache.chain()

    @functools.cached_property
    def position(self) -> int:
        """The position of its first token: what the cache continues, then `start`."""
        return sum(n for _, n in self.chain) + self.start


@dataclass
class Plan:
    """The segments of one forward pass, in the order of its tokens. With a `group` (`kv.DecodeGroup`),
    the segments `lanes` names are its members' decode steps, in the order of its members."""

    segments: list[Segment]
    windows: tuple[int | None, ...]  # each layer's sliding window, None for none (`Engine.windows`)
    group: DecodeGroup | None = None
    lanes: tuple[int, ...] = ()
    _masks: dict = field(default_factory=dict)

    @functools.cached_property
    def lane_steps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's step: where each member writes (lane, position); made once a pass."""
        device = self.group.keys[0].device
        positions = torch.tensor([self.segments[i].start for i in self.lanes], device=device)
        return torch.arange(len(positions), device=device), positions

    def lane_mask(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mask that keeps each member's query to its own keys, and to the last `window` of all it
        reads (a layer's sliding window), [members, 1, 1, longest + 1]: bool, or, when the members continue
        a prefix, added to the scores (0 or -inf, in the keys' dtype, what the kernel that also returns
        log-sum-exps takes); and, when the window leaves some of that prefix out for some member, the
        first position of it each member reads ([members]; else None). Made once a pass per window."""
        key = ("lanes", window)
        if key not in self._masks:
            _, positions = self.lane_steps
            columns = torch.arange(int(positions.max()) + 1, device=positions.device)
            allowed = columns <= positions[:, None]
            first = None
            if window is not None:
                prefix = sum(n for _, n in self.group.chain)
                starts = positions + prefix + 1 - window  # each member's first key, counted from the prefix's first
                allowed &= columns >= (starts - prefix)[:, None]
                if prefix and int(starts.max()) > 0:
                    first = starts.clamp(min=0)
            allowed = allowed[:, None, None, :]
            self._masks[key] = (_additive(allowed, self.group.keys[0].dtype) if self.group.chain else allowed, first)
        return self._masks[key]

    @functools.cached_property
    def sizes(self) -> list[int]:
        """How many tokens of the batch each segment takes, in order."""
        return [segment.tokens for segment in self.segments]

    def mask(self, start: int, length: int, device, window: int | None = None) -> torch.Tensor:
        """The causal mask of `length` queries after `start` cached tokens: query i sees keys 0..start+i,
        the last `window` of them only when the layer has a sliding window."""
        key = (start, length, window)
        if key not in self._masks:
            self._masks[key] = _causal_mask(start, length, device, window)
        return self._masks[key]


@dataclass
class Probe:
    """A plan for one throw-away forward pass that teaches the store each layer's key/value shape, and
    collects each layer's sliding window as its attention is told it (`windows`: the call's keyword, or
    the module's own attribute), the keywords of the calls that this attention does not run (`unrun`), and
    the modules that call it with no layer index, whose keys no cache could hold (`unplaced`)."""

    store: KVStore
    windows: dict[int, int | None] = field(default_factory=dict)
    unrun: set[str] = field(default_factory=set)
    unplaced: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Scoring:
    """What a model's attention does to its scores beside scaling them, which SDPA does not: Gemma 2's
    soft-capping (`softcap * tanh(score / softcap)`, before the mask), and the sinks of GPT-OSS (`s_aux`:
    one logit per head that joins the softmax's denominator and attends to nothing). Attention with
    either runs in plain operations, as transformers' eager attention of those models does."""

    softcap: float | None
    sinks: torch.Tensor | None  # [heads]

    @classmethod
    def of(cls, keywords: dict) -> "Scoring | None":
        softcap, sinks = keywords.get("softcap"), keywords.get("s_aux")
        return None if softcap is None and sinks is None else cls(softcap, sinks)


# Keywords models pass to their attention that change nothing here, and those this attention runs (the
# sliding window, `Scoring`'s). Any other, unless None or False (`is_causal`: unless True), is a computation
# this attention would leave out: the model is refused at load rather than give other tokens.
INERT_KEYWORDS = frozenset({"position_ids", "use_cache", "output_router_logits", "output_attentions", "cache_position",
                            "logits_to_keep",  # which positions the output layer keeps (got_ocr2 passes it on)
                            "position_embeddings"})
RUN_KEYWORDS = frozenset({"sliding_window", "softcap", "s_aux"})


def unrun_keywords(keywords: dict) -> set[str]:
    """The keywords of an attention call that would change its result and that this attention does not run."""
    return {name for name, value in keywords.items()
            if (value is not True if name == "is_causal" else
                name not in INERT_KEYWORDS | RUN_KEYWORDS and value is not None and value is not False)}


def rows_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scoring = Scoring.of(kwargs)
    kv_plan = _plan.get()
    if kv_plan is None:
        if scoring is not None:  # transformers' SDPA refuses a softcap, and has no sinks
            return _scored(query, key, value, scaling, _causal(attention_mask, query, key), scoring).transpose(1, 2), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if isinstance(kv_plan, Probe):
        if not isinstance(getattr(module, "layer_idx", None), int):  # a cache is a layer's: this call has none
            kv_plan.unplaced.add(type(module).__name__)
            return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, dropout=dropout)
        kv_plan.store.learn(module.layer_idx, key.shape[1], key.shape[3], value.shape[3], key.dtype)
        kv_plan.windows[module.layer_idx] = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        kv_plan.unrun.update(unrun_keywords({"is_causal": getattr(module, "is_causal", True), **kwargs}))
        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, dropout=dropout)
    layer = module.layer_idx
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    window = kv_plan.windows[layer]  # a query reads the last `window` keys, itself included
    segments, lanes = kv_plan.segments, kv_plan.lanes
    if lanes and len(lanes) == len(segments):  # a step of sessions decoding alone: the common tick
        return _decode_lanes(kv_plan, layer, query, key, value, scaling, gqa, scoring, window).transpose(1, 2).contiguous(), None
    if len(segments) == 1:
        parts = [(segments[0], query, key, value)]
    else:  # one split a tensor, not three slices a segment: a decode step of many sessions has dozens a layer
        sizes = kv_plan.sizes
        parts = list(zip(segments, query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2)))
    outputs = [None] * len(parts)  # each [1, heads, tokens, head_dim]
    if lanes:
        together = [torch.cat([parts[i][n] for i in lanes], dim=2) for n in (1, 2, 3)]
        for i, out in zip(lanes, _decode_lanes(kv_plan, layer, *together, scaling, gqa, scoring, window).split(1, dim=2)):
            outputs[i] = out
    for i, (segment, q, k, v) in enumerate(parts):
        if outputs[i] is not None:
            continue
        if segment.length == 1:
            outputs[i] = _decode(segment, layer, q, k, v, scaling, gqa, scoring, window)
        else:
            keys, values = segment.cache.write(layer, segment.row, segment.start, k[0], v[0], segment.chain)
            mask = None  # a whole prompt from position 0 within any window: SDPA's own causal flag
            end = segment.position + segment.length
            if segment.position > 0 or scoring is not None or (window is not None and end > window):
                mask = kv_plan.mask(segment.position, segment.length, query.device, window)
            if scoring is not None:
                outputs[i] = _scored(q, keys, values, scaling, mask, scoring)
                continue
            out, _ = sdpa_attention_forward(module, q, keys, values, mask, scaling=scaling, dropout=dropout)
            outputs[i] = out.transpose(1, 2)
    # contiguous, as transformers' own attention returns it: models that `view` it (Afmoe, Dory) failed, and
    # the `reshape` of the others copies it anyway
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)).transpose(1, 2).contiguous(), None


def _decode_lanes(plan: Plan, layer: int, query, key, value, scaling, gqa: bool, scoring: Scoring | None,
                  window: int | None) -> torch.Tensor:
    """The decode step of the group's members, one token each: `query` [1, heads, members, head_dim] and
    the fresh `key`/`value` [1, kv_heads, members, head_dim] in the order of its members. Their keys and
    values are written to their lanes in one indexed write each, and attended in one SDPA call over the
    lanes up to the longest, a mask keeping each member to its own (and to its `window`, `Plan.lane_mask`);
    returns [1, heads, members, head_dim]."""
    lanes, positions = plan.lane_steps
    mask, first = plan.lane_mask(window)
    keys, values = plan.group.keys[layer], plan.group.values[layer]
    keys[lanes, :, positions] = key[0].transpose(0, 1)
    values[lanes, :, positions] = value[0].transpose(0, 1)
    longest = mask.shape[-1]
    keys, values = keys[:, :, :longest], values[:, :, :longest]
    if plan.group.chain:
        return _decode_after_prefix(_spans(plan.group.chain)[0], layer, query[0], keys, values, scaling, scoring, mask,
                                    first).transpose(1, 2)
    if scoring is not None:
        return _scored(query.transpose(0, 2), keys, values, scaling, mask, scoring).transpose(0, 2)
    out = F.scaled_dot_product_attention(query.transpose(0, 2), keys, values, attn_mask=mask, scale=scaling,
                                         enable_gqa=gqa)
    return out.transpose(0, 2)


def _decode(segment: Segment, layer: int, query, key, value, scaling, gqa: bool, scoring: Scoring | None,
            window: int | None) -> torch.Tensor:
    """One new token for each of `segment.rows` rows that share a length: one SDPA call for all of them.

    The call transformers' SDPA attention makes for one query without a mask, batched over the rows:
    `query` [1, heads, rows, head_dim] and the fresh `key`/`value` [1, kv_heads, rows, head_dim] of the
    flattened batch become [rows, heads, 1, head_dim] (a transpose, no copy); returns
    [1, heads, rows, head_dim]. A sliding `window` reads the last keys only: a slice, as the rows share it.
    """
    keys, values = segment.cache.write_rows(layer, segment.row, segment.rows, segment.start,
                                            key.transpose(0, 2), value.transpose(0, 2))
    drop = 0 if window is None else max(0, segment.position + 1 - window)  # the keys before the window
    if segment.chain:
        spans, own = _spans(segment.chain, drop)
        if own:
            keys, values = keys[:, :, own:], values[:, :, own:]
        return _decode_after_prefix(spans, layer, query[0], keys, values, scaling, scoring).transpose(1, 2)
    if drop:  # slices cost microseconds even when empty: a tenth of the call
        keys, values = keys[:, :, drop:], values[:, :, drop:]
    if scoring is not None:
        return _scored(query.transpose(0, 2), keys, values, scaling, None, scoring).transpose(0, 2)
    out = F.scaled_dot_product_attention(query.transpose(0, 2), keys, values, scale=scaling, enable_gqa=gqa)
    return out.transpose(0, 2)


def layer_windows(config, told: list[int | None], masked: bool = True) -> tuple[int | None, ...]:
    """Each layer's sliding window: what its attention is told (`Probe.windows`), else, if the model's masks
    read the config's window (`masked`: `fidelity.reads_config_window`), what they give it, which this
    attention does not read: the config's `sliding_window` on its layers of `layer_types`
    "sliding_attention", or on every layer when it has no `layer_types` (Qwen2-MoE and PhiMoE apply their
    windows through the mask alone)."""
    window, kinds = getattr(config, "sliding_window", None) if masked else None, getattr(config, "layer_types", None)
    masked = [window if kinds is None or kinds[i] == "sliding_attention" else None for i in range(len(told))]
    return tuple(mine if mine is not None else theirs for mine, theirs in zip(told, masked))


def _spans(chain: list[tuple[KVCache, int]], drop: int = 0) -> tuple[list[tuple[KVCache, int, int]], int]:
    """The prefix `chain` reads ((cache, tokens read), in order) less its first `drop` tokens, as (cache,
    first, end) spans; and how many of the tokens after the prefix are dropped too."""
    spans = []
    for cache, n in chain:
        skipped = min(n, drop)
        drop -= skipped
        if skipped < n:
            spans.append((cache, skipped, n))
    return spans, drop


def _decode_after_prefix(spans, layer: int, query, keys, values, scaling, scoring: Scoring | None = None,
                         mask=None, first=None) -> torch.Tensor:
    """Attention of one new token per row over a prefix all rows share, then each row's own keys.

    The prefix (`spans` of caches, `_spans`) is read in place, once for all rows (the rows' queries
    stacked), instead of once per row from a copy: for n samples or beams of a long prompt, or sessions
    continuing a shared system prompt, most of what attention reads. Each part is attended alone, and
    the parts are merged by their log-sum-exps, which is exactly one softmax over all the keys (up to
    rounding). A `scoring`'s sinks join that merge as one more part, of no values.
    `query` is [heads, rows, head_dim]; `keys`/`values` [rows, kv_heads, suffix, head_dim]; `mask`, added
    to the scores of the rows' own keys, [rows, 1, 1, suffix] (the decode group's lanes, of several lengths);
    `first`, with a sliding window, the first position of the prefix each row reads ([rows]).
    """
    heads, rows, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    q = query.transpose(0, 1).reshape(rows, kv_heads, group, dim)  # the heads of one kv head side by side
    stacked = q.transpose(0, 1).reshape(1, kv_heads, rows * group, dim)
    softcap = scoring.softcap if scoring is not None else None
    parts, position = [], 0  # each [1, kv_heads, rows * group, ...]
    firsts = None if first is None else first.repeat_interleave(group)[:, None]  # each stacked query's
    for cache, start, end in spans:
        part = cache.keys[layer][:1, :, start:end], cache.values[layer][:1, :, start:end]
        if firsts is None:
            parts.append(_attend(stacked, *part, scale, softcap=softcap))
        else:  # the window's start differs by row: a mask, and no part at all for a row that reads none of it
            columns = torch.arange(position, position + end - start, device=query.device)
            seen = columns >= firsts  # [rows * group, its tokens]
            if bool(seen.any()):
                out, lse = _attend(stacked, *part, scale, _additive(seen[None, None], part[0].dtype), softcap)
                unread = ~seen.any(dim=1)  # the kernel gives such a row 0 for its log-sum-exp, not -inf
                parts.append((out.masked_fill(unread[:, None], 0.0), lse.masked_fill(unread, float("-inf"))))
        position += end - start
    if rows > 1:  # back to one row per query
        parts = [(out.view(kv_heads, rows, group, -1).transpose(0, 1), lse.view(kv_heads, rows, group).transpose(0, 1))
                 for out, lse in parts]
    parts.append(_attend(q, keys, values, scale, mask, softcap))  # [rows, kv_heads, group, ...]
    if scoring is not None and scoring.sinks is not None:
        out = parts[-1][0]
        sinks = scoring.sinks.to(torch.float32).view(1, kv_heads, group).expand(out.shape[0], -1, -1)
        parts.append((torch.zeros_like(out), sinks))
    weights = torch.stack([lse for _, lse in parts]).softmax(dim=0).unsqueeze(-1)  # each part's share of the softmax
    out = (torch.stack([out for out, _ in parts]) * weights).sum(dim=0)
    return out.to(query.dtype).reshape(1, rows, heads, -1)  # the values' width: the keys' but in MLA


def _attend(q, k, v, scale: float, mask=None, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` [b, h, n, d] over `k`/`v` [b, h, m, d], `mask` (if any) added to the scores (or, bool,
    the keys each query sees): the output and each query's log-sum-exp of scores ([b, h, n], float32),
    which let attention over parts of the keys be merged. On CPU, the fused kernel SDPA itself runs (it
    returns both); elsewhere, with a `softcap`, or with values narrower than the keys (MLA), which that
    kernel refuses, the same in plain ops."""
    if q.device.type == "cpu" and softcap is None and v.shape[-1] == q.shape[-1]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                               scale=scale)
        return out, lse
    return _attend_plain(q, k, v, scale, mask, softcap)


def _attend_plain(q, k, v, scale: float, mask=None, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    if mask is not None and mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    elif mask is not None:
        scores += mask
    lse = scores.logsumexp(dim=-1)
    return torch.matmul((scores - lse.unsqueeze(-1)).exp_().to(v.dtype), v), lse


def _scored(q, k, v, scaling, mask, scoring: Scoring) -> torch.Tensor:
    """Attention with a `Scoring`, in plain ops: `q` [b, heads, n, d] over `k`/`v` [b, kv_heads, m, d],
    `mask` (bool: the keys each query sees, or added) [b or 1, 1, n, m]; returns [b, heads, n, d]."""
    b, heads, n, dim = q.shape
    kv_heads, group = k.shape[1], heads // k.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    grouped = q.reshape(b, kv_heads, group * n, dim)  # head h is kv head h // group: its queries side by side
    if mask is not None:
        mask = mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(mask.shape[0], 1, group * n, mask.shape[-1])
    out, lse = _attend_plain(grouped, k, v, scale, mask, scoring.softcap)
    if scoring.sinks is not None:  # exp(lse) / (exp(lse) + exp(sink)): the share the keys keep
        sinks = scoring.sinks.to(torch.float32).view(kv_heads, group, 1).expand(-1, -1, n).reshape(kv_heads, group * n)
        out = out * torch.sigmoid(lse - sinks).unsqueeze(-1).to(out.dtype)
    return out.reshape(b, heads, n, -1)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as one added to the scores: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _causal_mask(start: int, length: int, device, window: int | None = None) -> torch.Tensor:
    """bool [1, 1, length, start + length]: query i sees keys 0..start+i, the last `window` of them only."""
    allowed = torch.ones(length, start + length, dtype=torch.bool, device=device).tril(start)
    return (allowed if window is None else allowed.triu(start + 1 - window))[None, None]


def _causal(mask, query, key):
    """The mask transformers' SDPA mask function made for a call without a plan, or, where it left one out
    for SDPA's causal flag, the causal mask it stands for (the queries are the last of the keys)."""
    return mask if mask is not None else _causal_mask(key.shape[2] - query.shape[2], query.shape[2], query.device)


AttentionInterface.register(NAME, rows_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def install(model) -> None:
    """Switches a loaded model to this attention (it remains plain SDPA for calls without a plan)."""
    model.set_attn_implementation(NAME)
