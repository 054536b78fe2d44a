"""Sessions: a token history plus the KV cache of its prefix, reused by longest common prefix.

Every `generate` means what it would mean on a fresh session. Internally the cache keeps the longest
common prefix of the cached tokens and the new input (at least the last input token is always fed again,
so there are logits to sample from), and only the rest is prefilled. The cache holds generated tokens
too, so a chat follow-up that repeats the previous answer reuses it.

The rolling case (`abc` then `bcd`) shares no prefix and recomputes. Under causal attention the keys
of `bcd` differ from those cached for `abc`, so exact reuse of a shifted window is impossible.
"""

from __future__ import annotations

import inspect
import secrets
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import DynamicCache

import processors as proc

from .decode import check_logits, decode_step, prefill, sample
from .errors import SessionBusy, SessionClosed
from .text import Detokenizer, StopMatcher

STRATEGIES = ("greedy", "sample")


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "length" | "eos" | "stop" | "cancelled"
    stats: Stats


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # the text this token completes; '' while held back (partial character, possible stop)


@dataclass(frozen=True)
class Request:
    """A validated generate call."""

    input_ids: list[int]
    max_new_tokens: int
    greedy: bool
    seed: int | None
    chain: proc.Chain
    stop: tuple[str, ...]
    eos_token_ids: frozenset[int]


@dataclass
class Checkpoint:
    """What a session held before a call, enough to put it back exactly if the call fails.

    Only the tail of the cache that the call crops away is copied (nothing, when the new input extends
    what is cached); the kept prefix is never written in place, so cropping back to it restores it.
    """

    history: list[int]
    cache: object
    cached: int
    keep: int = 0
    tail: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def cache_bytes(cache) -> int:
    if cache is None:
        return 0
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )


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
        self.cache = None  # KV of history[:cached]
        self.cached = 0
        self.closed = False
        # The generation under way, weakly: a stream its caller dropped unfinished ends (as if
        # cancelled where it stood) instead of keeping the session busy for ever.
        self._running: weakref.ref | None = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        running = self.running
        if running is not None:
            running.cancel()
        self.drop_cache()
        self.closed = True
        self.engine._forget(self)

    def drop_cache(self) -> None:
        self.cache, self.cached = None, 0

    @property
    def busy(self) -> bool:
        """A generation of this session has started and not finished."""
        running = self.running
        return running is not None and not running.done

    @property
    def running(self) -> "Generation | None":
        return self._running() if self._running is not None else None

    @property
    def cache_bytes(self) -> int:
        return cache_bytes(self.cache)

    def generate(self, prompt: str | None = None, **options) -> Result:
        """Generates to the end and returns the `Result`.

        Options (declared once, in `Engine.validate`): `token_ids` or `messages` (instead of `prompt`;
        messages are `[{"role": ..., "content": ...}]` rendered by the model's chat template, with
        `chat_template`, `add_generation_prompt` and `continue_final_message` as in transformers),
        `max_new_tokens=16`, `strategy="greedy" | "sample"`, `seed`, `processors` (configs or callables),
        `stop` (strings), `eos_token_ids` (default: the model's; `[]` never stops early).
        """
        generation = self.stream(prompt, **options)
        for _ in generation:
            pass
        return generation.result

    def stream(self, prompt: str | None = None, **options) -> "Generation":
        """A generate call as an iterator of `TokenEvent`s; `.result` is set once it is exhausted.

        Everything is validated here, before the session changes, so a rejected call leaves it as it was.
        """
        if self.closed:
            raise SessionClosed(f"session {self.id} is closed")
        if self.busy:
            raise SessionBusy(f"session {self.id} is already generating; finish or cancel that generation first")
        request = self.engine.validate(prompt, **options)
        generation = Generation(self, request)
        self._running = weakref.ref(generation)
        return generation

    def _reuse(self, input_ids: list[int]) -> Checkpoint:
        """Crops the cache to the longest reusable prefix of `input_ids`; the checkpoint's `keep` is its length."""
        saved = Checkpoint(self.history, self.cache, self.cached)
        if self.cache is None:
            self.cache = DynamicCache()
            self.cached = 0
        saved.keep = keep = min(common_prefix(self.history[: self.cached], input_ids), len(input_ids) - 1)
        if self.cached > keep:
            saved.tail = [(layer.keys[..., keep : self.cached, :].clone(), layer.values[..., keep : self.cached, :].clone())
                          for layer in self.cache.layers]
            self.cache.crop(keep - self.cached)
        self.cached = keep
        return saved

    def _restore(self, saved: Checkpoint) -> None:
        """Puts back what `_reuse` saved: the history, and the cache cropped to the kept prefix plus its old tail."""
        self.history, self.cache, self.cached = saved.history, saved.cache, saved.cached
        if saved.cache is None:
            return
        for i, layer in enumerate(saved.cache.layers):
            if getattr(layer, "keys", None) is None:
                continue
            keys, values = layer.keys[..., : saved.keep, :], layer.values[..., : saved.keep, :]
            if saved.tail:
                keys, values = torch.cat([keys, saved.tail[i][0]], dim=-2), torch.cat([values, saved.tail[i][1]], dim=-2)
            layer.keys, layer.values = keys, values


class Generation:
    """One generate call, run one decode step per `next()` (or one prefill chunk or decode step per
    `step()`), so callers can interleave and cancel.

    The texts of the events, joined, are exactly `result.text`.
    """

    def __init__(self, session: Session, request: Request):
        self.session = session
        self.request = request
        self._run = _Run(session, request)
        self._steps = self._run.steps()

    @property
    def result(self) -> Result | None:
        return self._run.result

    @property
    def done(self) -> bool:
        return self._run.done

    def __iter__(self) -> Iterator[TokenEvent]:
        return self

    def __next__(self) -> TokenEvent:
        while (event := next(self._steps)) is None:
            pass
        return event

    def step(self) -> TokenEvent | None:
        """One unit of work: a prefill chunk (None) or a decode step (its event); StopIteration at the end.

        A caller that runs several generations (the server) steps each in turn, so a long prompt's
        prefill does not hold up the others, and a cancel takes effect between chunks.
        """
        return next(self._steps)

    def cancel(self) -> None:
        """Stops before the next step; the result keeps the tokens so far, with finish_reason 'cancelled'.

        Called from inside a step (a processor, another thread), it only marks the generation: the step
        under way finishes and the next one does not start.
        """
        self._run.cancelled = True
        if inspect.getgeneratorstate(self._steps) == inspect.GEN_RUNNING:
            return
        for _ in self:
            pass


class _Run:
    """The state of a generation's steps, apart from `Generation`: its generator refers to this and not
    to the `Generation`, so a stream its caller drops is freed at once (no cycle to wait for the
    collector) and ends where it stood."""

    def __init__(self, session: Session, request: Request):
        self.session = session
        self.request = request
        self.result: Result | None = None
        self.done = False
        self.cancelled = False

    def steps(self) -> Iterator[TokenEvent | None]:
        session, request = self.session, self.request
        started = time.perf_counter()
        stats = Stats(prompt_tokens=len(request.input_ids))
        generated: list[int] = []
        pieces: list[str] = []
        finish = "cancelled"  # cancelled before its first step: nothing ran, nothing changed
        saved = None
        try:
            session.engine._touch(session)
            if not self.cancelled:
                saved = session._reuse(request.input_ids)
                finish = yield from self._decode(saved.keep, started, stats, generated, pieces)
        except GeneratorExit:  # dropped unfinished: it stands where it was, like a cancel (consistent at a yield)
            raise
        except BaseException:
            # A failed call leaves the session exactly as it was, half-written cache and history undone.
            if saved is not None:
                session._restore(saved)
            raise
        finally:
            self.done = True
        stats.generated_tokens = len(generated)
        stats.total_s = time.perf_counter() - started
        self.result = Result("".join(pieces), generated, finish, stats)
        session.engine._settle(session)

    def _decode(self, reused: int, started: float, stats: Stats, generated: list[int], pieces: list[str]):
        """Prefill, then sample / decode-step until a finish reason; returns that reason.

        With `max_new_tokens` 0 it only prefills: the input is then cached for the next call.
        """
        session, request, engine = self.session, self.request, self.session.engine
        detokenizer, stops = Detokenizer(engine.tokenizer), StopMatcher(request.stop)
        generator = None
        if not request.greedy:
            generator = torch.Generator(device=engine.model.device)
            generator.manual_seed(request.seed if request.seed is not None else secrets.randbits(63))

        stats.reused_tokens = reused
        fresh = request.input_ids[reused:]
        session.history = list(request.input_ids)
        chunk = engine.prefill_chunk
        for offset in range(0, len(fresh), chunk):
            if offset:  # between chunks: other work may run, and a cancel stops the prefill here
                yield None
                if self.cancelled:
                    return "cancelled"
            piece = fresh[offset : offset + chunk]
            with torch.inference_mode():
                logits = prefill(engine.model, session.cache, piece, reused + offset, chunk)
            session.cached = reused + offset + len(piece)
            stats.prefill_tokens = offset + len(piece)
        if request.max_new_tokens == 0:
            return "length"

        prompt_length = len(request.input_ids)
        sequence = torch.empty(1, prompt_length + request.max_new_tokens, dtype=torch.long)
        sequence[0, :prompt_length] = torch.tensor(request.input_ids)
        vocab = logits.shape[-1]
        context = proc.Context(sequence, prompt_length, prompt_length, vocab)
        # Processors run in inference mode too, so that in-place edits of the logits (the transformers
        # idiom) are allowed on the tensors the model returned.
        with torch.inference_mode():
            states = request.chain.init(context)
        while not self.cancelled:
            with torch.inference_mode():
                states, processed = request.chain.process(states, logits, context)
            check_logits(processed, request.chain, logits.shape)
            token = sample(processed, request.greedy, generator)
            if stats.ttft_s is None:
                stats.ttft_s = time.perf_counter() - started
            generated.append(token)
            session.history.append(token)
            sequence[0, context.length] = token
            context = proc.Context(sequence, context.length + 1, prompt_length, vocab)

            is_eos = token in request.eos_token_ids
            text = "" if is_eos else stops.feed(detokenizer.push(token))
            finish = None
            if stops.stopped:
                finish = "stop"
            elif is_eos or len(generated) == request.max_new_tokens:
                text += stops.feed(detokenizer.flush())
                finish = "stop" if stops.stopped else ("eos" if is_eos else "length")
                text += stops.flush()
            pieces.append(text)
            yield TokenEvent(token, text)
            if finish is not None:
                return finish
            if self.cancelled:  # no forward pass for a token nobody will see
                break
            with torch.inference_mode():
                logits = decode_step(engine.model, session.cache, token, session.cached)
            session.cached += 1
        # Cancelled: the text is what was streamed. Text still held back (an incomplete character, a
        # possible stop string) stays out of it, though its tokens are in token_ids and the history.
        return "cancelled"
