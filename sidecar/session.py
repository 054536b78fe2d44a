"""Sessions: a token history plus the KV cache of its prefix, reused by longest common prefix.

Every `generate` means what it would mean on a fresh session. Internally the cache keeps the longest
common prefix of the cached tokens and the new input (at least the last input token is always fed again,
so there are logits to sample from), and only the rest is prefilled. The cache holds generated tokens
too, so a chat follow-up that repeats the previous answer reuses it.

A prefix held by another session's cache (a shared system prompt) is continued in place rather than
recomputed (`sidecar.sharing`).

The rolling case (`abc` then `bcd`) shares no prefix and recomputes by default. Under causal attention
the keys of `bcd` differ from those cached for `abc`, so exact reuse of a shifted window is impossible;
`reuse="shift"` opts into an approximate reuse that moves the cached keys instead (`sidecar.shift`).
Keys a shift moved are never shared with other sessions (`KVCache.exact`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import processors as proc

from . import persist, sharing, shift
from .errors import SampleMismatch, SessionBusy, SessionClosed
from .kv import KVCache
from .sequences import Continuable, Tokens, continuation

STRATEGIES = ("greedy", "sample", "beam")
REUSES = ("prefix", "shift")


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # cached input tokens not computed again
    shared_tokens: int = 0  # of those, how many another session's cache held
    shifted_tokens: int = 0  # of those, how many reuse="shift" moved (approximate)
    prefill_tokens: int = 0
    generated_tokens: int = 0  # over every returned sequence
    ttft_s: float | None = None
    total_s: float = 0.0


@dataclass
class Sequence(Continuable):
    """One generated sequence. It continues (`sequences.Tokens`) from all its ids: the call's input, then
    what it generated (every token, an ending EOS and a trimmed stop string's included)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "length" | "eos" | "stop" | "cancelled"
    score: float | None = None  # beam search: sum of log-probs / generated length ** length_penalty
    logprobs: list[float] | None = None  # with logprobs=k: each token's log-probability under the model
    top_logprobs: list[list[tuple[int, float]]] | None = None  # and each step's k most likely (id, logprob)
    prompt_ids: list[int] = field(default_factory=list, repr=False)  # the call's input ids
    tokenizer: object = field(default=None, repr=False, compare=False)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    @property
    def tokens(self) -> Tokens:
        return Tokens(tuple(self.all_ids), self.tokenizer)


@dataclass
class Result(Continuable):
    """A generate call's outcome: the best (or first) sequence, and all of them in `sequences`.

    It continues as its sequence when it has one; with several, one must be chosen (`SampleMismatch`).
    """

    text: str
    token_ids: list[int]
    finish_reason: str  # "length" | "eos" | "stop" | "cancelled"
    stats: Stats
    sequences: list[Sequence] = field(default_factory=list)
    logprobs: list[float] | None = None  # the best sequence's, with logprobs=k
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # with prompt_logprobs=k: the prompt's ids, each one's log-probability given those before it (None for the
    # first, which follows nothing), and the k most likely there; as far as the prompt was computed
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def tokens(self) -> Tokens:
        if len(self.sequences) != 1:
            raise SampleMismatch(f"the result holds {len(self.sequences)} sequences (samples or beams): continue "
                                 "one of them, result.sequences[i]", sequences=len(self.sequences))
        return self.sequences[0].tokens


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # the text this token completes; '' while held back (partial character, possible stop)
    sequence: int = 0  # which of the `num_samples` sequences it extends
    logprob: float | None = None  # with logprobs=k: the token's log-probability under the model
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # and the step's k most likely (id, logprob)


@dataclass(frozen=True)
class Request:
    """A validated generate call."""

    input_ids: list[int]
    max_new_tokens: int
    strategy: str
    seed: int | None
    chain: proc.Chain
    stop: tuple[str, ...]
    eos_token_ids: frozenset[int]
    num_samples: int = 1
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    logprobs: int | None = None  # report each token's log-probability and this many of the most likely
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (the prompt is computed anew)
    shift_keep: int | None = None  # reuse="shift": the leading tokens a shift keeps; None: prefix reuse only


@dataclass
class Checkpoint:
    """What a session held before a call, enough to put it back exactly if the call fails.

    Only the tokens of its own cache that the call crops away are copied (from `start` on; nothing, when
    the new input extends what is cached); the kept part is never written in place, so cropping back to
    it restores it. A shift writes the `shifted` tokens after the kept ones: its tail starts before
    them. The cache it continued (`prefix`) is held until the call ends, so it is still there to
    continue again.
    """

    history: list[int]
    own: int  # tokens of its own cache
    prefix: KVCache | None
    prefix_length: int
    approximate_from: int | None
    keep: int = 0  # leading input tokens reused, shifted ones included
    shared: int = 0  # of which another session's cache held
    shifted: int = 0  # of which a shift moved
    start: int = 0
    tail: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self):
        if self.prefix is not None:
            self.prefix.refs += 1

    def drop(self) -> None:
        """Lets the cache it held go (the call has ended)."""
        if self.prefix is not None:
            prefix, self.prefix = self.prefix, None
            prefix.store.unref(prefix)


class Session:
    def __init__(self, engine, session_id: int):
        self.engine = engine
        self.id = session_id
        self.history: list[int] = []  # every token of the last call: its input and what it generated
        self.last: Result | None = None  # of the last call that ran (not failed ones): what `continuation` reads
        self.cache = engine.store.cache()  # KV of history[:cached]
        self.closed = False

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self.engine.lock:
            run = self.engine.scheduler.run_of(self)
            if run is not None:
                self.engine.scheduler.cancel(run)
            self.closed = True
            self.engine.store.release(self.cache)
            self.engine._forget(self)

    @property
    def cached(self) -> int:
        """How many leading tokens of `history` the cache holds (with the shared prefix it continues)."""
        return self.cache.end

    @property
    def busy(self) -> bool:
        """A generation of this session has started and not finished (one whose stream was dropped while
        another thread held the engine, too: the next step or call ends it)."""
        return self.engine.scheduler.run_of(self) is not None

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    def generate(self, prompt: str | Continuable | None = None, **options) -> Result:
        """Generates to the end and returns the `Result`.

        `prompt` is a text, or a sequence to continue: a result of one sequence, one of a result's
        `sequences`, or `Tokens` made from them (`seq[:k]`, `seq.cut(chars=n)`, `seq + "text"`).
        Options (declared once, in `Engine.validate`): `token_ids` or `messages` (instead of `prompt`;
        messages are `[{"role": ..., "content": ...}]` rendered by the model's chat template, with
        `chat_template`, `add_generation_prompt`, `continue_final_message`, `tools`, `documents` and
        `chat_template_kwargs` as `apply_chat_template` takes them),
        `max_new_tokens`, `strategy="greedy" | "sample" | "beam"`, `seed`, `processors` (configs or
        callables), `stop` (strings), `eos_token_ids` (default: the model's; `[]` never stops early; left
        out, `max_new_tokens` (16 unless the config says), `strategy`, `processors` and `stop` are the model's
        generation config's, `Engine.generation_defaults`; `generation_config={"temperature": 0.7}` changes its
        fields for this call, the others kept, as `model.generate(temperature=0.7)` does; a transformers
        `GenerationConfig` there changes the fields it sets, as `model.generate(generation_config=...)` does),
        `num_samples` (sample), `num_beams`, `num_return_sequences`, `length_penalty`, `early_stopping`
        (beam, as in transformers), `reuse="prefix" | "shift"` and `keep` (shift: leading tokens kept).
        """
        generation = self.stream(prompt, **options)
        try:
            for _ in generation:
                pass
        except BaseException:  # Ctrl-C among them: the call stops as a cancelled one, and the session is free
            generation.cancel()
            raise
        return generation.result

    def stream(self, prompt: str | Continuable | None = None, **options):
        """A generate call as an iterator of `TokenEvent`s; `.result` is set once it is exhausted.

        Everything is validated here, before the session changes, so a rejected call leaves it as it was.
        Beam search streams no events (beams are reordered until the end); its result has them all.
        """
        from .generation import Generation

        with self.engine.lock:
            self._check_free()
        # Outside the lock, as it changes nothing: rendering a chat or compiling a constraint may take long,
        # and other threads' steps go on meanwhile.
        request = self.engine.validate(prompt, **options)
        with self.engine.lock:
            self._check_free()  # again: another thread may have closed it, or started a call, meanwhile
            return Generation(self, request)

    def _check_free(self) -> None:
        """Refuses a call on a closed or busy session, or from a processor of a step under way."""
        if self.closed:
            raise SessionClosed(f"session {self.id} is closed")
        run = self.engine.scheduler.run_of(self)
        if run is not None and run.cancelled:  # a stream dropped while another thread held the engine: over now
            self.engine.scheduler.cancel(run)
        elif run is not None:
            raise SessionBusy(f"session {self.id} is already generating; finish or cancel that generation first")
        self.engine.scheduler.check_outside_tick()

    def continuation(self, sequence: int = 0, tokens: int | None = None, chars: int | None = None,
                     append: str | None = None, append_token_ids: list[int] | None = None) -> Tokens:
        """Sequence `sequence` of the last result, cut to its first `tokens` tokens (negative: all but the
        last) or `chars` characters, then extended by `append` (a text) or `append_token_ids`: what the
        protocol's `generate.continue` generates from."""
        return continuation(self.last, sequence, tokens, chars, append, append_token_ids)

    def fork(self) -> "Session":
        """An independent session with this one's history, cache and last result (copied, not recomputed)."""
        with self.engine.lock:
            return persist.fork(self)

    def save(self, path) -> None:
        """Writes the history and the cache to `path` (safetensors); `Engine.restore(path)` brings it back."""
        with self.engine.lock:
            persist.save(self, path)

    def reusable(self, input_ids: list[int]) -> int:
        """How many leading tokens of `input_ids` its own cache holds and a call would reuse (the last input
        token is always fed again, so there are logits to sample from)."""
        return min(sharing.common_prefix(self.history, input_ids, end=self.cached), len(input_ids) - 1)

    def _reuse(self, input_ids: list[int], own: int, source: sharing.Source | None = None,
               shift_keep: int | None = None, restorable: bool = True) -> Checkpoint:
        """Crops the cache to the `own` tokens of `input_ids` it holds (`reusable`), makes it continue
        `source` (another cache holding more of them), or, with `shift_keep`, shifts it when that reuses
        more; the checkpoint's `keep` is how many are reused. Unless `restorable`, what a crop drops is not
        copied aside: a failure then leaves the cache cropped (the history is put back whole).

        Should that fail midway (memory, the model's rotary module), the cache may be half moved: it is
        emptied instead (the history stays, so the next call recomputes), and what it held is let go."""
        cache = self.cache
        saved = Checkpoint(self.history, cache.length, cache.prefix, cache.prefix_length, cache.approximate_from)
        try:
            return self._reuse_into(saved, input_ids, own, source, shift_keep, restorable)
        except BaseException:
            cache.clear()
            saved.drop()
            raise

    def _reuse_into(self, saved: Checkpoint, input_ids: list[int], own: int, source: sharing.Source | None,
                    shift_keep: int | None, restorable: bool) -> Checkpoint:
        cache, store = self.cache, self.engine.store
        if source is not None and source.tokens > own:
            saved.keep = saved.shared = source.tokens
            entry = source.take()
            if cache.length:
                saved.tail = cache.tail(0)
            cache.length = 0
            cache.approximate_from = None
            store.link(cache, entry, saved.keep)
            return saved
        moved = None if shift_keep is None else shift.align(self.history[: cache.end], input_ids, shift_keep)
        if moved is not None and moved.reused > own:
            if moved.keep >= cache.offset:  # the moved tokens are its own, and move within its buffers
                saved.start = moved.keep - cache.offset
                saved.tail = moving = cache.tail(saved.start)
            else:  # they start in the shared prefix it continues, never written: moved, they become its own
                moving = [tuple(part[None, :, moved.keep :] for part in cache.span(layer))
                          for layer in range(len(store.layers))]
                saved.tail = cache.tail(0) if cache.length else []
                cache.length = 0
                store.link(cache, cache.prefix, moved.keep)
                cache.reserve(max(cache.capacity, moved.count))
            shift.move(cache, self.engine.rotation, moved, moving)
            saved.keep, saved.shifted = moved.reused, moved.count
            if cache.approximate_from is None or moved.keep < cache.approximate_from:
                cache.approximate_from = moved.keep
            return saved
        saved.keep = own
        saved.start = min(max(own - cache.offset, 0), cache.length)
        if cache.length > saved.start and restorable:
            saved.tail = cache.tail(saved.start)
        cache.crop(own)
        return saved

    def _restore(self, saved: Checkpoint) -> None:
        """Puts back what `_reuse` saved: the history, the link, and its own cache cropped to what it left in
        place plus its old tail."""
        self.history = saved.history
        cache = self.cache
        store = self.engine.store
        store.link(cache, saved.prefix, saved.prefix.offset + saved.prefix_length if saved.prefix is not None else 0)
        cache.length = saved.start
        if saved.tail:
            cache.reserve(max(cache.capacity, saved.own))
            cache.put_tail(saved.start, saved.tail)
        cache.approximate_from = saved.approximate_from
