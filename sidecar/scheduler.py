"""The scheduler: one forward pass per tick for every active row of every session of one engine.

Each tick it
1. admits waiting runs in arrival order while the KV store can hold what each needs to its end
   (evicting idle caches first; planned leaner when the faster plan does not fit: `Run.footprint`);
   a run that cannot fit waits while others run (and the runs behind it wait too: none is starved by
   smaller ones), and is refused with `cache_budget_exceeded` at once if it could not fit even alone;
2. builds one batch: a token for every decoding row, then prefill chunks under the per-tick token
   budget (`prefill_chunk`): half of it to the oldest prompt, the rest shortest remaining prompt first,
   so that a short request gets its first token while a long prompt is still being prefilled, and no
   prompt waits for ever behind shorter ones;
3. runs the model once and hands each run its rows of logits. The single rows of sessions decoding
   together attend in one call a layer, their caches copied side by side into a `DecodeGroup` while
   no generation waits for memory.

A failure inside one run (its processors, its sampling) fails that run alone; a failing forward pass
fails the runs that were in it. Either way each such run puts its session back as it was. An exception
no run catches (Ctrl-C lands anywhere in a step: in the model, in a run's processors, in the group's
copy) leaves the step through the thread that runs it, after `_interrupted` has made the rest whole.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections import deque

import torch

from .attention import Plan
from .decode import forward
from .errors import CacheBudgetExceeded, InvalidProcessor
from .generation import Feed, Run
from .kv import GROUP_MAX_TOKENS, DecodeGroup, KVCache


class Scheduler:
    def __init__(self, engine):
        self.engine = engine
        self.waiting: deque[Run] = deque()
        self.running: list[Run] = []
        self.ticking = False
        self.ticks = 0
        self.group = engine.store.group  # the sessions decoding together (`_forward`)
        self.current: Run | None = None  # the run whose own part of the step runs now (`_interrupted`)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, run: Run) -> None:
        self.waiting.append(run)

    def run_of(self, session) -> Run | None:
        """The session's generation that has started and not finished, waiting or running (one at most):
        what makes it busy, found here rather than kept beside (a finished run, kept, would hold its
        processors' states until the session's next call).

        Read without the engine's lock: asking whether a session is busy never waits for another thread's
        step. The two lists are copied in one go (no other thread runs meanwhile); a caller that acts on
        the answer holds the lock already."""
        return next((run for run in (*self.running, *self.waiting) if run.session is session and not run.done), None)

    def cancel(self, run: Run) -> None:
        """Cancels a run now, or at the end of the tick under way (a processor cancelling)."""
        with self.engine.lock:
            run.cancelled = True
            if not self.ticking:
                with torch.inference_mode():
                    run.finish("cancelled")
                self._forget_done()

    def check_outside_tick(self) -> None:
        """Refuses to start or advance a generation from inside a step (a processor calling its own engine):
        the step under way would be run again from the middle, its own runs included. Called holding the
        engine's lock, so a step under way is this thread's (another thread's waits for the lock)."""
        if self.ticking:
            raise InvalidProcessor("a processor called its engine (generate, or the next token of a stream) in the "
                                   "middle of a step, which cannot run one step inside another; call it after the "
                                   "generation, or on another engine")

    def tick(self) -> None:
        with self.engine.lock:
            self.check_outside_tick()
            try:
                self.ticking = True
                with torch.inference_mode():
                    self._admit()
                    self._finish_cancelled()  # marked between steps (a stream dropped while the lock was held): fed no more
                    feeds = self._plan()
                    if feeds:
                        self._forward(feeds)
                    self._finish_cancelled()  # by a processor of this step
            except BaseException as stopping:
                self._interrupted(stopping)
                raise
            finally:
                self.ticking = False
                self.ticks += 1
            self._forget_done()

    def _finish_cancelled(self) -> None:
        """Ends the running generations marked cancelled, and forgets them: a run ended part-way through its
        prefill still has tokens to feed, which a plan would feed. Most steps end none: the lists stay as they are."""
        ended = False
        for run in self.running:
            if run.cancelled and not run.done:
                self.current = run
                run.finish("cancelled")
                self.current = None
                ended = True
        if ended:
            self._forget_done()

    def _interrupted(self, stopping: BaseException) -> None:
        """Makes whole a step that an exception stopped part-way: the decode group is let go (its members'
        own buffers catch up), and the run it stopped in its admission or in taking its logits, whichever
        thread's call that is, is cancelled, since its step is half taken (going on, it fed a token twice).
        The runs before it took their step, those after it did not and run it again: planning changes
        nothing, and the keys a forward pass wrote past a run's length are written again alike."""
        run, self.current = self.current, None
        with torch.inference_mode(), _ctrl_c_held(stopping):
            self.group.dissolve()
            if run is not None and not run.done:
                try:
                    run.finish("cancelled")
                except Exception as error:  # its rows stopped mid-change: put the session back instead
                    run.fail(error)
            self._forget_done()  # before the next step plans: a run ended here is planned no more

    def _forget_done(self) -> None:
        self.running = [run for run in self.running if not run.done]
        while self.waiting and self.waiting[0].done:
            self.waiting.popleft()
        if any(run.done for run in self.waiting):
            self.waiting = deque(run for run in self.waiting if not run.done)

    def _admit(self) -> None:
        store = self.engine.store
        while self.waiting:
            run = self.waiting[0]
            if run.done:
                self.waiting.popleft()
                continue
            if run.cancelled:
                self.current = run  # from before it leaves the queue until it is over or running (`_interrupted`)
                self.waiting.popleft()
                run.finish("cancelled")
                self.current = None
                continue
            tried = []  # the fastest plan first, leaner ones when it does not fit (`Run.footprint`)
            for footprint in map(run.footprint, (0, 1, 2)):
                if footprint in tried:  # a leaner plan may be the same (a shift's always are)
                    continue
                tried.append(footprint)
                if fits := store.make_room(footprint.needed_bytes, keep=footprint.held):
                    break
            if not fits:
                value = min(f.needed_bytes + store.alone_bytes(f.held) for f in tried)  # with nothing else cached
                if self.running and value <= store.budget_bytes:
                    return  # running generations will free memory: wait for them (and hold back those behind)
                self.current = run
                self.waiting.popleft()
                run.fail(CacheBudgetExceeded(
                    f"this generation needs {value} bytes of KV cache with every other cache evicted, more than "
                    f"the budget of {store.budget_bytes} (cache_budget_bytes)",
                    limit="cache_budget_bytes", max=store.budget_bytes, value=value))
                self.current = None
                continue
            self.current = run
            self.waiting.popleft()
            try:
                run.admit(footprint)
            except Exception as error:
                run.fail(error)
            if not run.done:
                self.running.append(run)
            self.current = None

    def _plan(self) -> list[Feed]:
        feeds: list[Feed] = []
        for run in self.running:
            if not run.prefilling and not run.done:
                feeds += run.plan(0)
        prefilling = [r for r in self.running if r.prefilling]
        for run, tokens in _prefill_shares(prefilling, self.engine.prefill_chunk, self.ticks % 2):
            feeds += run.plan(tokens)
        return feeds

    def _forward(self, feeds: list[Feed]) -> None:
        token_ids, positions, keep = [], [], []
        for feed in feeds:
            segment = feed.segment
            position = segment.position
            positions += range(position, position + segment.length) if segment.rows == 1 else [position] * segment.rows
            token_ids += feed.token_ids
            keep += range(len(token_ids) - feed.logits, len(token_ids))
        lanes = [] if self.waiting else _lanes(feeds, self.group)  # a waiting generation: the group's copy would keep it waiting
        chain = feeds[lanes[0]].segment.chain if lanes else []
        grouped = self.group.update([feeds[i].segment.cache for i in lanes], chain)
        plan = Plan([f.segment for f in feeds], self.engine.windows, self.group if grouped else None,
                    tuple(lanes) if grouped else ())
        try:
            logits = forward(self.engine.model, token_ids, positions, plan, keep)
        except Exception as error:
            for run in {id(f.run): f.run for f in feeds}.values():
                self.current = run
                run.fail(error)
            self.current = None
            return
        row = 0
        for run, fed in _by_run(feeds):
            wanted = sum(feed.logits for feed in fed)
            rows = logits[row : row + wanted] if wanted else None
            row += wanted
            self.current = run
            try:
                run.accept(fed, rows)
            except Exception as error:
                run.fail(error)
            self.current = None


@contextlib.contextmanager
def _ctrl_c_held(stopping: BaseException):
    """Holds off Ctrl-C while a step that `stopping` stopped is made whole: a second one there (a user
    pressing it twice) stopped the mending part-way, a run left half-stepped among the running ones.
    Python handles signals in the main thread alone, so only there can one arrive, and only its default
    handler raises (another is the application's, left alone). One that arrives meanwhile is raised once
    the step is whole, unless the step is leaving with a KeyboardInterrupt already. (One that arrives
    before the hold, in the few instructions between the first exception and it, still lands there.)"""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    noted = []
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if noted and not isinstance(stopping, KeyboardInterrupt):
        raise KeyboardInterrupt


def _prefill_shares(prefilling: list[Run], budget: int, odd: int) -> list[tuple[Run, int]]:
    """How many prompt tokens each prefilling run (in admission order) feeds this tick, `budget` in all:
    half to the oldest (an odd budget's middle token on every other tick, `odd`), then the shortest
    remaining prompts first, and what is left to the oldest again. Shortest first lets a short request
    get its first token while a long prompt is prefilled; the oldest's half bounds every wait, where
    shortest first alone starved a long prompt for as long as shorter ones kept coming (found from
    outside: a 122-token prompt waited over two minutes behind a stream of short ones, at 8 tokens a tick)."""
    if not prefilling:
        return []
    oldest, *others = prefilling
    first = min(oldest.feedable, (budget + odd) // 2)
    budget -= first
    shares = []
    for run in sorted(others, key=lambda r: len(r.fresh)):
        tokens = min(run.feedable, budget)
        if tokens <= 0:
            break
        shares.append((run, tokens))
        budget -= tokens
    first += min(budget, oldest.feedable - first)
    return [(oldest, first)] + shares if first else shares


def _lanes(feeds: list[Feed], group: DecodeGroup) -> list[int]:
    """Which feeds decode as a group (`kv.DecodeGroup`): single rows of sessions whose own caches are
    small enough, among them those continuing one prefix (none, or a shared system prompt's). That is
    the group's own prefix while all its members still decode: a burst of other requests does not
    dissolve it, to be copied again once they end. Otherwise the prefix most of them continue, the
    first such on a tie, so the same group is found step after step."""
    by_chain: dict[tuple, list[int]] = {}
    for i, feed in enumerate(feeds):
        segment = feed.segment
        if feed.run.width == 1 and segment.length == 1 and segment.cache.capacity <= GROUP_MAX_TOKENS:
            by_chain.setdefault(_key(segment.chain), []).append(i)
    if group.members:
        kept = by_chain.get(_key(group.chain), [])
        if {id(member) for member in group.members} <= {id(feeds[i].segment.cache) for i in kept}:
            return kept
    return max(by_chain.values(), key=len, default=[])


def _key(chain: list[tuple[KVCache, int]]) -> tuple:
    return tuple((id(cache), n) for cache, n in chain)


def _by_run(feeds: list[Feed]):
    """Groups consecutive feeds of the same run (a run's feeds are planned together)."""
    group: list[Feed] = []
    for feed in feeds:
        if group and feed.run is not group[0].run:
            yield group[0].run, group
            group = []
        group.append(feed)
    if group:
        yield group[0].run, group
