"""A generate call as an explicit state machine that never calls the model.

The scheduler asks each `Run` what it needs fed next (`plan`: a prefill chunk, or one token per
decoding row, with their positions) and, after one forward pass for every run together, hands it its
rows of logits (`accept`). From those the run applies its processors, picks tokens (greedy, sampled,
or beam search) and queues `TokenEvent`s. `Generation` is the caller's handle: iterating it ticks the
engine's scheduler until the run has an event, so a lone Python caller and the server drive the same
machine.

Several rows: `num_samples` or `num_beams`. The prompt is prefilled once in the session's own cache,
which the rows of a working cache then share as their prefix, or copy when it is short. Rows that
finish are dropped (their cache rows and processor states go with one index, `Chain.reorder`); beams
are reordered the same way every step.
The session keeps the prompt's cache and, as its history, the prompt plus the first sequence.
"""

from __future__ import annotations

import secrets
import time
from array import array
from collections import deque
from dataclasses import dataclass

import torch

import processors as proc

from . import logprobs, sharing
from .attention import Segment
from .beams import BeamSearch
from .decode import check_logits, pick
from .errors import SidecarError, refusal_of
from .session import Result, Sequence, Stats, TokenEvent
from .text import StopMatcher, detokenizer, generated_text

# Rows share the prompt's cache (instead of each holding a copy) once the copies would hold this many
# tokens: attention over a shared prefix costs a dozen small operations a layer, which pays only when
# it spares reading that much (measured on the default model: 4 beams of a 32-token prompt are faster
# with copies, 8 samples of a 512-token prompt much faster shared).
SHARE_PREFIX_TOKENS = 1024
# A run asked for prompt_logprobs feeds its prompt at most this many tokens a tick: the logits of each token
# fed are kept, 128 MiB for this many at a 128k vocabulary's width (as float32, then their log-softmax).
PROMPT_LOGITS_TOKENS = 128


@dataclass(frozen=True)
class Footprint:
    """One way to run a generation within the KV memory budget (`Run.footprint`): the input tokens the
    session's own cache holds (`Session.reusable`), another cache holding more of them (`sharing.find`),
    the caches admission must not evict to make room for it, and the bytes it adds to the store."""

    own: int
    source: sharing.Source | None
    held: tuple
    needed_bytes: int
    restorable: bool  # a failure puts back what the call crops from the session's cache
    shares_prefix: bool  # its rows read the prompt from the session's cache, not from copies of their own


@dataclass
class Feed:
    """Tokens a run wants fed in this tick, and how many rows of logits it wants back: the last token's
    (1), every row's (a decode step of several rows), or none (a prefill chunk that is not the last)."""

    run: "Run"
    segment: Segment
    token_ids: list[int]
    logits: int


class _Row:
    """One sequence being sampled: its tokens, its text so far, and its stop matcher."""

    def __init__(self, index: int, tokenizer, vocabulary, stop, context, with_logprobs: bool):
        self.index = index
        self.token_ids: list[int] = []
        self.records = array("d") if with_logprobs else None  # `logprobs.records`, one after another
        self.pieces: list[str] = []
        self.detokenizer = detokenizer(tokenizer, vocabulary, context)
        self.stops = StopMatcher(stop)
        self.finish: str | None = None

    def sequence(self) -> Sequence:
        sequence = Sequence("".join(self.pieces), self.token_ids, self.finish or "cancelled")
        if self.records is not None:
            sequence.logprobs, sequence.top_logprobs = logprobs.unpacked(self.records, len(self.token_ids))
        return sequence


class Run:
    def __init__(self, session, request):
        self.session = session
        self.request = request
        self.events: deque[TokenEvent] = deque()
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.done = False
        self.cancelled = False
        self.stats = Stats(prompt_tokens=len(request.input_ids))
        self.started = time.perf_counter()
        self.saved = None  # the session's checkpoint, taken when admitted
        self.admitted_as: Footprint | None = None  # how it runs, chosen when admitted
        self.fresh: list[int] = []  # prompt tokens still to prefill
        self.work = None  # the KVCache the rows decode in (the session's own for one row)
        self.rows: list[_Row] = []  # the sequences still decoding, in the order of `work`'s rows
        self.all_rows: list[_Row] = []
        self.next_tokens: list[int] = []
        self.beams: BeamSearch | None = None
        # with prompt_logprobs: the prompt tokens' `logprobs.records` after the first, as far as computed
        self.prompt_records = array("d") if request.prompt_logprobs is not None else None
        self.accept_result = None  # see `Generation.accept_result`

    # ---- admission -------------------------------------------------------------------------------

    @property
    def width(self) -> int:
        """Rows it decodes: beams, samples, or one."""
        return self.request.num_beams if self.request.strategy == "beam" else self.request.num_samples

    def footprint(self, lean: int = 0) -> "Footprint":
        """How it would run at leanness `lean`: where the input's cached prefix comes from (the session's
        own cache, or another one: `source`), and the bytes of KV memory to add to the store before it can
        run to its end. Reads the session and the store; changes nothing.

        `lean` 1 plans what fits a tight budget, when the faster plan does not: rows share the prompt
        instead of copying it (input + rows x max_new_tokens, as the protocol promises); no other
        session's cache is continued, since keeping it may take more than computing the prefix again
        would once that cache is evicted; and what the call crops from the session's cache is let go
        at once instead of kept for a failure to put back. Leaner still (2), the session reuses nothing,
        so that its cache and the shared prefix it continues may be evicted too: a prefix it continues
        stays whole while continued, however little of it the call reuses."""
        cache, request, session = self.session.cache, self.request, self.session
        from_scratch = lean == 2 and request.shift_keep is None  # a shift always reuses its window
        # whether a failure puts back what the call crops from the session's cache (a shift's always does)
        restorable = not lean or request.shift_keep is not None
        shares_prefix = self.width > 1 and bool(lean or len(request.input_ids) * (self.width - 1) >= SHARE_PREFIX_TOKENS)
        # prompt_logprobs: every prompt token's logits, which no cache keeps, so nothing is reused (as vLLM does)
        scored = request.prompt_logprobs is not None
        own = 0 if from_scratch or scored else session.reusable(request.input_ids)
        source = None  # a shift reuses the session's own window: it does not look elsewhere
        if request.shift_keep is None and not lean and not scored:
            source = sharing.find(session, request.input_ids[:-1], own)
        offset = source.tokens if source is not None else min(cache.offset, own)  # where its own tokens start
        if request.shift_keep is not None:  # a shift may move tokens out of a prefix it continues
            offset = min(offset, request.shift_keep)
        prompt, total = len(request.input_ids) - offset, len(request.input_ids) + request.max_new_tokens - offset
        # A call that crops the cache keeps its capacity until it ends, so that a failure can put the
        # cropped tail back without growing past the budget (a lean one lets it go: `restorable`).
        kept = cache.length if restorable else 0
        # what its buffers hold now is counted as used; reusing nothing, it may lose them to eviction
        # instead, and then needs all it holds anew
        has = 0 if from_scratch else cache.nbytes
        if self.width == 1:
            needed = cache.bytes_for(1, max(total, kept)) - has
        else:
            working = cache.bytes_for(self.width, request.max_new_tokens if shares_prefix else total + offset)
            needed = cache.bytes_for(1, max(prompt, kept)) - has + working
        held = () if from_scratch else (cache,) if source is None else (cache, source.cache)
        return Footprint(own, source, held, needed, restorable, shares_prefix)

    @property
    def admitted(self) -> bool:
        return self.admitted_as is not None

    @property
    def shares_prefix(self) -> bool:
        """Whether its rows read the prompt from the session's cache rather than from copies of their own."""
        return self.admitted_as.shares_prefix

    def admit(self, footprint: "Footprint") -> None:
        """Starts it as `footprint` plans (one of its footprints, which the store made room for)."""
        session, request = self.session, self.request
        self.admitted_as = footprint
        restorable = footprint.restorable
        self.saved = session._reuse(request.input_ids, footprint.own, footprint.source, request.shift_keep, restorable)
        session.engine._touch(session)  # after the reuse: the chain it now continues is used too
        self.stats.reused_tokens = self.saved.keep
        self.stats.shared_tokens = self.saved.shared
        self.stats.shifted_tokens = self.saved.shifted
        self.fresh = request.input_ids[self.saved.keep :]
        session.history = list(request.input_ids)
        cache = session.cache
        cache.pinned = True
        extra = request.max_new_tokens if self.width == 1 else 0
        cache.reserve(max(len(request.input_ids) + extra - cache.offset, self.saved.own if restorable else 0))
        if self.width > 1:  # the rows' own cache, reserved now: what admission counted is what is held
            self.work = session.engine.store.cache(self.width)
            self.work.pinned = True
            self.work.reserve(request.max_new_tokens if self.shares_prefix else len(request.input_ids) + request.max_new_tokens)

    # ---- one tick --------------------------------------------------------------------------------

    @property
    def prefilling(self) -> bool:
        return bool(self.fresh)

    @property
    def feedable(self) -> int:
        """The prompt tokens it can take in one tick: those left, at most PROMPT_LOGITS_TOKENS with prompt_logprobs
        (the logits of every token fed are kept, a vocabulary's width each)."""
        return len(self.fresh) if self.prompt_records is None else min(len(self.fresh), PROMPT_LOGITS_TOKENS)

    def plan(self, budget: int) -> list[Feed]:
        if self.fresh:
            n = min(self.feedable, budget)
            if n <= 0:
                return []
            cache = self.session.cache
            wanted = n if self.prompt_records is not None else int(n == len(self.fresh))
            return [Feed(self, Segment(cache, 0, cache.length, n), self.fresh[:n], wanted)]
        rows = len(self.next_tokens)
        return [Feed(self, Segment(self.work, 0, self.work.length, 1, rows), self.next_tokens, rows)]

    def accept(self, fed: list[Feed], logits: torch.Tensor | None) -> None:
        """Takes the rows of logits for what was fed (None when nothing asked for logits). A processor's
        typed failure (a contract broken, a grammar's parser giving up or taking too long) is raised as the
        engine's error (`refusal_of`). Nothing is taken once its session was closed during the step (by another generation's processor):
        its cache is gone, and the step's end finishes it as cancelled."""
        if self.session.closed:
            return
        try:
            self._accept(fed, logits)
        except proc.ProcessorError as error:
            raise refusal_of(error) from error

    def _accept(self, fed: list[Feed], logits: torch.Tensor | None) -> None:
        if self.fresh:
            n = fed[0].segment.length
            if self.prompt_records is not None:
                logits = self._score_prompt(logits)
            self.session.cache.length += n
            self.stats.prefill_tokens += n
            self.fresh = self.fresh[n:]
            if self.fresh:
                return
            if self.request.max_new_tokens == 0:
                self.finish("length")
                return
            self._start_decoding(logits)
        else:
            self.work.length += 1
        self._choose(logits)

    def _score_prompt(self, logits: torch.Tensor) -> torch.Tensor:
        """Records the log-probability of each prompt token the chunk's logits predict (the logits of token i
        predict token i + 1), and returns the last row, the next token's logits, for the prompt's last chunk."""
        input_ids = self.request.input_ids
        start = len(input_ids) - len(self.fresh)  # the chunk's first token, in the prompt
        targets = input_ids[start + 1 : start + 1 + len(logits)]
        if targets:
            log_probs = logits[: len(targets)].log_softmax(dim=-1)
            top = logprobs.top_of(log_probs, self.request.prompt_logprobs)
            self.prompt_records.extend(logprobs.records(log_probs, torch.tensor(targets, device=logits.device), top).flatten().tolist())
        return logits[-1:]

    def _start_decoding(self, logits: torch.Tensor) -> None:
        request, session = self.request, self.session
        engine = session.engine
        prompt, width = len(request.input_ids), self.width
        if width == 1:
            self.work = session.cache
        else:
            if self.shares_prefix:
                engine.store.link(self.work, session.cache, session.cache.end)  # the prompt, read by every row
            else:
                self.work.copy_prefix(session.cache)
        self.sequence = torch.empty(width, prompt + request.max_new_tokens, dtype=torch.long, device=logits.device)
        self.sequence[:, :prompt] = torch.tensor(request.input_ids, device=logits.device)
        self.context = proc.Context(self.sequence, prompt, prompt, logits.shape[-1])
        self.states = request.chain.init(self.context)
        self.generator = None
        if request.strategy == "sample":
            self.generator = torch.Generator(device=logits.device)
            self.generator.manual_seed(request.seed if request.seed is not None else secrets.randbits(63))
        if request.strategy == "beam":
            self.beams = BeamSearch(width, request.max_new_tokens, request.eos_token_ids, request.length_penalty,
                                    request.early_stopping, logits.shape[-1], logits.device, request.logprobs)
        self.rows = self.all_rows = [_Row(i, engine.tokenizer, engine.vocabulary, request.stop, request.input_ids,
                                          request.logprobs is not None) for i in range(width)]

    def _choose(self, logits: torch.Tensor) -> None:
        """Processes the logits of the decoding rows and appends one token to each."""
        if logits.shape[0] != len(self.rows):  # the prompt's logits, for every row (a copy: processors may edit in place)
            logits = logits.expand(len(self.rows), -1).clone()
        if self.beams is not None:
            logits = logits.log_softmax(dim=-1)  # beam search scores log-probabilities, as transformers does
        chain = self.request.chain
        # the model's own, for logprobs, before processors edit `logits` (in place or not): a copy for beams
        model_log_probs = None
        if self.request.logprobs is not None:
            model_log_probs = logits.clone() if self.beams is not None else logits.log_softmax(dim=-1)
        processed = logits
        if chain.processors:
            self.states, processed = chain.process(self.states, logits, self.context)
        check_logits(processed, chain, logits.shape, logits.device)
        if self.stats.ttft_s is None:
            self.stats.ttft_s = time.perf_counter() - self.started
        if self.beams is not None:
            self._beam_step(processed, model_log_probs)
        else:
            self._sample_step(processed, model_log_probs)

    def _advance_context(self, tokens: torch.Tensor) -> None:
        length = self.context.length
        self.sequence[:, length] = tokens
        self.context = proc.Context(self.sequence, length + 1, self.context.input_length, self.context.vocab_size)

    def _sample_step(self, processed: torch.Tensor, model_log_probs: torch.Tensor | None) -> None:
        request = self.request
        ended = len(self.rows) < self.width  # samples that ended still draw (`pick`)
        tokens = pick(processed, request.strategy == "greedy", self.generator,
                      [row.index for row in self.rows] if ended else None, self.width)
        self._advance_context(tokens)
        token_list = tokens.tolist()
        found = (logprobs.records(model_log_probs, tokens, logprobs.top_of(model_log_probs, request.logprobs)).tolist()
                 if model_log_probs is not None else None)
        keep = []
        for position, (row, token) in enumerate(zip(self.rows, token_list)):
            row.token_ids.append(token)
            if found is not None:
                row.records.extend(found[position])
            if self.width == 1:
                self.session.history.append(token)
            is_eos = token in request.eos_token_ids
            text = "" if is_eos else row.stops.feed(row.detokenizer.push(token))
            if row.stops.stopped:
                row.finish = "stop"
            elif is_eos or len(row.token_ids) == request.max_new_tokens:
                text += row.stops.feed_last(row.detokenizer.flush(), row.detokenizer.cut())
                row.finish = "stop" if row.stops.stopped else ("eos" if is_eos else "length")
            row.pieces.append(text)
            if found is None:
                self.events.append(TokenEvent(token, text, row.index))
            else:
                (logprob,), (top,) = logprobs.unpacked(found[position], 1)
                self.events.append(TokenEvent(token, text, row.index, logprob, tuple(top)))
            if row.finish is None:
                keep.append(position)
        if not keep:
            self.finish(self.all_rows[0].finish)
            return
        if len(keep) < len(self.rows):
            self._keep_rows(torch.tensor(keep, device=tokens.device))
        self.next_tokens = [token_list[i] for i in keep]

    def _keep_rows(self, index: torch.Tensor) -> None:
        """Rows `index` go on: their cache rows, processor states and sequences follow one index."""
        self.work.select(index)
        self.states = self.request.chain.reorder(self.states, index)
        self.sequence = self.sequence.index_select(0, index)
        self.context = proc.Context(self.sequence, self.context.length, self.context.input_length, self.context.vocab_size)
        self.rows = [self.rows[i] for i in index.tolist()]

    def _beam_step(self, processed: torch.Tensor, model_log_probs: torch.Tensor | None) -> None:
        index, tokens = self.beams.step(processed, model_log_probs)
        if self.beams.done:
            self.finish_beams()
            return
        if not torch.equal(index, torch.arange(len(index), device=index.device)):
            self.work.select(index, alike=0 if self.shares_prefix else len(self.request.input_ids))
            self.states = self.request.chain.reorder(self.states, index)
            self.sequence = self.sequence.index_select(0, index)
        self._advance_context(tokens)
        self.next_tokens = tokens.tolist()

    # ---- the end ---------------------------------------------------------------------------------

    def finish_beams(self, cancelled: bool = False) -> None:
        """Ends a beam search with its best finished hypotheses, or, cancelled, its best running beams."""
        request, tokenizer, vocabulary = self.request, self.session.engine.tokenizer, self.session.engine.vocabulary
        count = request.num_return_sequences
        found = self.beams.running_results(count) if cancelled else self.beams.results(count)
        sequences = []
        for token_ids, score, records in found:
            is_eos = bool(token_ids) and token_ids[-1] in request.eos_token_ids
            text = generated_text(tokenizer, vocabulary, token_ids[:-1] if is_eos else token_ids, request.input_ids)
            reason = "cancelled" if cancelled else "eos" if is_eos else "length"
            sequences.append(Sequence(text, token_ids, reason, score))
            if records is not None:
                sequences[-1].logprobs, sequences[-1].top_logprobs = logprobs.unpacked(records, len(token_ids))
        self._settle(sequences, sequences[0].finish_reason)

    def finish(self, reason: str) -> None:
        """Ends the run with `reason`; a row still decoding (a cancel) keeps what it has, as 'cancelled'."""
        if self.done:
            return
        if self.beams is not None:
            self.finish_beams(cancelled=True)
            return
        self._settle([row.sequence() for row in self.all_rows] or self._empty_sequences(reason), reason)

    def _empty_sequences(self, reason: str) -> list[Sequence]:
        """A run that ends before its first token (`max_new_tokens` 0, or cancelled before decoding) has as
        many sequences as one that generated: every sample, or the best `num_return_sequences` beams, all
        empty. An empty beam is scored 0.0, the sum of no log-probabilities (transformers' generate refuses
        max_new_tokens 0, so there is no score of its own to follow)."""
        empty = ([], []) if self.request.logprobs is not None else (None, None)
        if self.request.strategy == "beam":
            return [Sequence("", [], reason, 0.0, *empty) for _ in range(self.request.num_return_sequences)]
        return [Sequence("", [], reason, None, *empty) for _ in range(self.width)]

    def _prompt_logprobs(self) -> tuple[list, list]:
        """The prompt's log-probabilities as far as computed: none before its first chunk, then None for its
        first token (it follows nothing) and one for each token the chunks' logits predicted."""
        if not self.stats.prefill_tokens:
            return [], []
        width = 1 + 2 * self.request.prompt_logprobs  # a token's record: its own, k ids, theirs (`logprobs.records`)
        scored, top = logprobs.unpacked(self.prompt_records, len(self.prompt_records) // width)
        return [None] + scored, [None] + top

    def _settle(self, sequences: list[Sequence], reason: str) -> None:
        session = self.session
        # admitted, then cancelled before a tick gave it a chunk of its prompt (the tick's budget went to
        # others): it ran nothing, and leaves the session as admission found it
        ran = self.admitted and self.stats.prefill_tokens > 0
        if self.admitted and not ran:
            self._leave_group()
            if not session.closed:
                self._put_back()
            self.stats.reused_tokens = self.stats.shared_tokens = self.stats.shifted_tokens = 0
        best = sequences[0]
        for sequence in sequences:
            sequence.prompt_ids, sequence.tokenizer = self.request.input_ids, session.engine.tokenizer
        self.stats.generated_tokens = sum(len(s.token_ids) for s in sequences)
        self.stats.total_s = time.perf_counter() - self.started
        result = Result(best.text, best.token_ids, reason, self.stats, sequences, best.logprobs, best.top_logprobs)
        if self.prompt_records is not None:
            result.prompt_token_ids = list(self.request.input_ids)
            result.prompt_logprobs, result.prompt_top_logprobs = self._prompt_logprobs()
        if self.admitted and self.accept_result is not None:
            try:
                self.accept_result(result)
            except SidecarError as refused:
                self.fail(refused)
                return
        if ran and self.width > 1:
            session.history = list(self.request.input_ids) + best.token_ids
        self.result = result
        if ran:  # a run cancelled before it ran left the session, and its last result, as they were
            session.last = self.result
        self._release()

    def fail(self, error: BaseException) -> None:
        """Puts the session back exactly as it was before the call, and keeps the error for the caller."""
        if self.done:
            return
        self._leave_group()
        self._put_back()
        if isinstance(error, StopIteration):  # re-raised from `Generation.__next__` it would end the stream as done
            stray = RuntimeError(f"a processor raised StopIteration ({error})" if str(error) else
                                 "a processor raised StopIteration")
            stray.__cause__ = error
            error = stray
        self.error = error
        self._release()

    def _put_back(self) -> None:
        """The session's history and cache as they were before admission changed them (`Session._reuse`)."""
        if self.saved is not None:
            try:
                self.session._restore(self.saved)
            except Exception:  # no memory to put the tail back: the history stays, the cache is recomputed
                self.session.history = self.saved.history
                self.session.cache.clear()

    def _leave_group(self) -> None:
        """Its cache's own buffers catch up with the decode group before anything reads or changes them."""
        group = self.session.engine.store.group
        if group.holds(self.session.cache):
            group.dissolve()

    def _release(self) -> None:
        self._leave_group()
        session = self.session
        if self.work is not None and self.work is not session.cache:
            session.engine.store.release(self.work)
        session.cache.pinned = False
        if self.saved is not None:
            self.saved.drop()
        if self.admitted and not session.closed:
            session.cache.reserve(session.cache.length)  # give back what was reserved and not used
        session.engine.store.touch(session.cache)
        self.done = True


class Generation:
    """A generate call: iterate it for `TokenEvent`s; `.result` is set once it is exhausted.

    Each `next()` ticks the engine's scheduler until this call has an event, so other calls of the same
    engine progress too. Dropping an unfinished generation cancels it.
    """

    def __init__(self, session, request):
        self.session = session
        self.request = request
        self._run = Run(session, request)
        self._raised = False
        session.engine.scheduler.submit(self._run)

    @property
    def result(self) -> Result | None:
        return self._run.result

    @property
    def done(self) -> bool:
        return self._run.done

    @property
    def error(self) -> BaseException | None:
        return self._run.error

    @property
    def accept_result(self):
        """None, or a callable given the result before the session keeps it (as its history and last
        result): one that raises a `SidecarError` fails the call with that error instead, the session as it
        was before it. The server refuses so a reply that would not fit in a frame."""
        return self._run.accept_result

    @accept_result.setter
    def accept_result(self, check) -> None:
        self._run.accept_result = check

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> TokenEvent:
        run, scheduler = self._run, self.session.engine.scheduler
        while not run.events:
            if run.done:
                if run.error is not None and not self._raised:  # raised once, like a generator; `error` keeps it
                    self._raised = True
                    raise run.error
                raise StopIteration
            scheduler.tick()
        return run.events.popleft()

    def take_events(self) -> list[TokenEvent]:
        """The events queued since the last call (the server sends them after each tick)."""
        with self.session.engine.lock:
            events = list(self._run.events)
            self._run.events.clear()
            return events

    def cancel(self) -> None:
        """Stops before the next forward pass; the result keeps the tokens so far, finish_reason 'cancelled'.

        Called during a tick (from a processor), it only marks the run: the tick finishes first.
        """
        self.session.engine.scheduler.cancel(self._run)

    close = cancel  # as a generator's: `contextlib.closing(session.stream(...))` ends it on the way out

    def __del__(self):
        run = getattr(self, "_run", None)
        if run is None or run.done:
            return
        lock = self.session.engine.lock
        # The collector may run this in any thread, one whose step or call holds the lock included: never
        # wait for it. Marked, the run is cancelled by the next step (or the one under way) instead.
        if not lock.acquire(blocking=False):
            run.cancelled = True
            return
        try:
            self.cancel()
        except Exception:  # interpreter shutdown: nothing left to put back
            pass
        finally:
            lock.release()

