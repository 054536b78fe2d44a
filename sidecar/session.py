"""Sessions: a token history plus the KV cache of its prefix, reused by longest common prefix.

Every `generate` means what it would mean on a fresh session. Internally the cache keeps the longest
common prefix of the cached tokens and the new input (at least the last input token is always fed again,
so there are logits to sample from), and only the rest is prefilled. The cache holds generated tokens
too, so a chat follow-up that repeats the previous answer reuses it.

The rolling case (`abc` then `bcd`) shares no prefix and recomputes. Under causal attention the keys
of `bcd` differ from those cached for `abc`, so exact reuse of a shifted window is impossible.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

import processors as proc

from . import persist
from .errors import SampleMismatch, SessionBusy, SessionClosed
from .sequences import Continuable, Tokens, continuation

STRATEGIES = ("greedy", "sample", "beam")


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
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


@dataclass
class Checkpoint:
    """What a session held before a call, enough to put it back exactly if the call fails.

    Only the tail of the cache that the call crops away is copied (nothing, when the new input extends
    what is cached); the kept prefix is never written in place, so cropping back to it restores it.
    """

    history: list[int]
    cached: int
    keep: int = 0
    tail: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Session:
    def __init__(self, engine, session_id: int):
        self.engine = engine
        self.id = session_id
        self.history: list[int] = []  # every token of the last call: its input and what it generated
        self.last: Result | None = None  # of the last call that ran (not failed ones): what `continuation` reads
        self.cache = engine.store.cache()  # KV of history[:cached]
        self.closed = False
        # The generation under way, weakly: a stream its caller dropped unfinished is cancelled where
        # it stood instead of keeping the session busy for ever.
        self._running: weakref.ref | None = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        running = self.running
        if running is not None:
            running.cancel()
        self.closed = True
        self.engine.store.release(self.cache)
        self.engine._forget(self)

    @property
    def cached(self) -> int:
        return self.cache.length

    @property
    def busy(self) -> bool:
        """A generation of this session has started and not finished."""
        running = self.running
        return running is not None and not running.done

    @property
    def running(self):
        return self._running() if self._running is not None else None

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    def generate(self, prompt: str | Continuable | None = None, **options) -> Result:
        """Generates to the end and returns the `Result`.

        `prompt` is a text, or a sequence to continue: a result of one sequence, one of a result's
        `sequences`, or `Tokens` made from them (`seq[:k]`, `seq.cut(chars=n)`, `seq + "text"`).
        Options (declared once, in `Engine.validate`): `token_ids` or `messages` (instead of `prompt`;
        messages are `[{"role": ..., "content": ...}]` rendered by the model's chat template, with
        `chat_template`, `add_generation_prompt` and `continue_final_message` as in transformers),
        `max_new_tokens=16`, `strategy="greedy" | "sample" | "beam"`, `seed`, `processors` (configs or
        callables), `stop` (strings), `eos_token_ids` (default: the model's; `[]` never stops early),
        `num_samples` (sample), `num_beams`, `num_return_sequences`, `length_penalty`, `early_stopping`
        (beam, as in transformers).
        """
        generation = self.stream(prompt, **options)
        for _ in generation:
            pass
        return generation.result

    def stream(self, prompt: str | Continuable | None = None, **options):
        """A generate call as an iterator of `TokenEvent`s; `.result` is set once it is exhausted.

        Everything is validated here, before the session changes, so a rejected call leaves it as it was.
        Beam search streams no events (beams are reordered until the end); its result has them all.
        """
        from .generation import Generation

        if self.closed:
            raise SessionClosed(f"session {self.id} is closed")
        if self.busy:
            raise SessionBusy(f"session {self.id} is already generating; finish or cancel that generation first")
        request = self.engine.validate(prompt, **options)
        generation = Generation(self, request)
        self._running = weakref.ref(generation)
        return generation

    def continuation(self, sequence: int = 0, tokens: int | None = None, chars: int | None = None,
                     append: str | None = None, append_token_ids: list[int] | None = None) -> Tokens:
        """Sequence `sequence` of the last result, cut to its first `tokens` tokens (negative: all but the
        last) or `chars` characters, then extended by `append` (a text) or `append_token_ids`: what the
        protocol's `generate.continue` generates from."""
        return continuation(self.last, sequence, tokens, chars, append, append_token_ids)

    def fork(self) -> "Session":
        """An independent session with this one's history, cache and last result (copied, not recomputed)."""
        return persist.fork(self)

    def save(self, path) -> None:
        """Writes the history and the cache to `path` (safetensors); `Engine.restore(path)` brings it back."""
        persist.save(self, path)

    def _reuse(self, input_ids: list[int]) -> Checkpoint:
        """Crops the cache to the longest reusable prefix of `input_ids`; the checkpoint's `keep` is its length."""
        cache = self.cache
        saved = Checkpoint(self.history, cache.length)
        saved.keep = keep = min(common_prefix(self.history[: cache.length], input_ids), len(input_ids) - 1)
        if cache.length > keep:
            saved.tail = cache.tail(keep)
            cache.crop(keep)
        return saved

    def _restore(self, saved: Checkpoint) -> None:
        """Puts back what `_reuse` saved: the history, and the cache cropped to the kept prefix plus its old tail."""
        self.history = saved.history
        self.cache.crop(saved.keep)
        if saved.tail:
            self.cache.reserve(max(self.cache.capacity, saved.cached))
            self.cache.put_tail(saved.keep, saved.tail)
