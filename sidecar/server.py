"""The protocol server: maps protocol ops onto engines and sessions.

One main thread does all the work. It owns the output, drains incoming frames between ticks, and
ticks each engine's scheduler, which runs one forward pass for every active generation of that model
together (continuous batching), so a long generation in one session does not delay a ping or a
generation in another. Requests for one session wait in that session's queue and run in arrival order.
Only compiling constraints runs elsewhere, on COMPILERS threads, configuring the processors and the input
of a generate that carries many bytes of them, on a thread of its own, and loading a model, or tokenizing
or detokenizing a large input, on another: none is waited for by the main thread. While a model loads (or
such a tokenize runs), the frames after its request wait unread.

Every request gets exactly one reply, whatever happens to it or to its session: a failure while it
starts or runs is an error on that request alone, and a session closed or unloaded under queued
requests answers each of them before the closing op's own reply.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import re
import queue
import secrets
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import processors as proc
from processors.structured import budget, forget_vocabulary, grammar
from processors.structured import compile as structured_compile
from processors.structured.compile import CompileCancelled
from processors.structured.constraints import Constraint
from processors.structured.grammar import llguidance_checks_deferred
from protocol import (
    OPS, PROTOCOL_VERSION, Limits, OversizedFrame, ProtocolError, Request, error, event, ok, pack, parse_request,
    peek_request_id, unpack,
)
from protocol import errors as codes
from protocol.limits import check_params
from protocol.schema import DEFAULT_NUM_BEAMS, request_id_of

from . import __version__, inputs
from .engine import DEFAULT_PREFILL_CHUNK, MAX_LOGPROBS, Engine
from .errors import InvalidArgument, InvalidProcessor, InvalidSessionFile, ReplyTooLarge, SessionClosed, SidecarError
from .generation import Generation
from .inputs import InputIds
from .sequences import continuation
from .session import STRATEGIES, Stats
from .torch_defaults import DEFAULTS
from .transport import EOF_MARK, UNREACHABLE, OutputFailed

log = logging.getLogger("sidecar")

SESSION_OPS = ("generate", "close_session", "session_info", "fork_session", "save_session")
SAVED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SAVED_SUFFIX = ".safetensors"

# Constraints compiled at once, each by its own thread. A compile runs in a child that may take up to
# COMPILE_MEMORY_BYTES (2 GiB) and a core for up to compile_timeout_s (300 s at most): with one at a time,
# a single pathological constraint held up every other session's constrained generate for its whole
# timeout; with one per request, a client's costly constraints could take the machine's memory and cores
# from the forward passes. Two: one such compile leaves a place for everyone else's, the children stay
# within 4 GiB and two cores, and a compile that no request waits for any more is stopped at once, freeing
# its place (so two stuck ones last only as long as the client lets them).
COMPILERS = 2
# A generate whose processors pack into more bytes than this is configured on the configuring thread, not on
# the main thread between every session's steps. Configuring is Python walking the options (a schema's
# checks, a dfa's transitions), about 2 ms per KB: up to 0.2-0.5 s for the largest values the limits allow,
# during which every stream paused. Below it, configuring costs less than the tick the hop would add.
CONFIGURE_INLINE_BYTES = 4096
# A generate whose frame is larger than this tokenizes its input (or renders its messages, or reads its token
# ids) on the configuring thread too, and a tokenize of a longer text or a detokenize of more ids is answered
# on a thread of its own: a tokenizer takes about 1 us a character (a second for a prompt of a megabyte,
# while every stream paused) and lets go of the GIL meanwhile. Below it, 10-20 ms at most.
INPUT_INLINE_BYTES = 16384
# How long a thread running Python (configuring, or a compile thread reading what its child made) keeps the
# GIL from the main thread, which asks for it back after every torch call that let go of it, hundreds a
# tick: while another thread configured a dfa of 20,000 transitions, a tick of 3 ms took the whole 0.4 s of
# it at Python's default 5 ms, 0.18 s at 0.5 ms, 44-55 ms at 0.1 ms (a thread alone is never interrupted).
SWITCH_INTERVAL_S = 0.0001
# KV memory let go since the heap was last trimmed (the most held since, less what is held) past which the server,
# once idle, hands the heap's free pages back to the system (`Server._give_back_memory`).
TRIM_BYTES = 64 * 2**20


def _heap_trimmer():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


@dataclass
class Job:
    request: Request  # while `shelved` or once its generation started, only SLIM_PARAMS of its parameters
    size: int  # bytes of its frame: what it holds in memory is bounded through them (max_queued_bytes)
    # Its frame, until it starts. A request that waits is `shelved`: its decoded form would take up to 20 times
    # the frame's bytes (a token id of 3 bytes on the wire is a Python int of 32 and a list slot of 8), so it
    # is decoded again when it starts (the same bytes and limits give the same request).
    frame: bytes | None = None
    shelved: bool = False
    generation: Generation | None = None
    streamed: bool = False
    processors: list | None = None  # a generate's, configured once it reaches the head of its queue
    configuring: bool = False  # its processors are being configured, or its input made, on the configuring thread
    configure_failure: Exception | None = None  # what configuring them raised there, raised again here
    input_ids: InputIds | None = None  # a large generate's input, made on the configuring thread right before
    input_failure: Exception | None = None  # it starts (`_prepare_first`), or what making it raised there
    prepared: Request | None = None  # its request, as decoded there: not decoded again on the main thread
    compiles: list = field(default_factory=list)  # (processor index, Compile) it waits for, in processor order
    compiled: bool = False  # its constraints are ready (or `problem` says why not)
    problem: SidecarError | None = None


SLIM_PARAMS = ("session", "new", "stream")  # what is read of a request that waits or runs


@dataclass(eq=False)
class Compile:
    """One constraint being compiled for one vocabulary, shared by every generate that waits for it. The
    main thread owns `waiting` and `done`; a compiling thread sets `problem`, then puts `Compiled` in the
    inbox. `stop` is set once no request waits for it any more: its child is killed, its failure not kept."""

    key: tuple  # (the constraint's compile_key, the vocabulary's fingerprint)
    constraint: Constraint
    vocabulary: object
    waiting: dict = field(default_factory=dict)  # request id -> Job
    stop: threading.Event = field(default_factory=threading.Event)
    problem: proc.ProcessorError | None = None
    compiled: object = None  # what it compiled, held until its generations bind it
    done: bool = False


@dataclass(frozen=True)
class Compiled:
    """Put in the inbox by a compiling thread: the generations waiting for `compile` may go on."""

    compile: Compile


@dataclass(frozen=True)
class Configured:
    """Put in the inbox by the configuring thread: `job`'s processors are configured, or failed to be."""

    job: Job


@dataclass(frozen=True)
class Answered:
    """Put in the inbox by a thread that answered `request` aside (a large tokenize or detokenize)."""

    request: Request
    reply: dict


@dataclass(frozen=True)
class Loaded:
    """Put in the inbox by the loading thread: the model of `request` loaded as `engine`, or `failure` says why not."""

    request: Request
    engine: Engine | None = None
    failure: BaseException | None = None


class Shutdown(Exception):
    """Raised inside the loop to stop serving with the given exit status."""

    def __init__(self, status: int):
        self.status = status


class Server:
    """The protocol's ops over engines and sessions.

    `model_roots`: `load_model` may only load directories under these (the embedded model, and paths
    given to `allow_path`, such as the CLI's `--model`, are always allowed). `trust_remote_code`: whether
    `load_model` may run code shipped inside a model directory at all.
    """

    def __init__(self, writer, *, limits: Limits = Limits(), model_roots=(), trust_remote_code: bool = False,
                 engine_options=None, session_dir=None):
        self.writer = writer
        self.limits = limits
        self.model_roots = tuple(Path(root).resolve() for root in model_roots)
        self.allowed_paths: set[Path] = set()
        # The operator's chat template for a model directory, replacing the model's own whenever that directory
        # is loaded, after an unload and a new load too (`use_chat_template`).
        self.operator_templates: dict[Path, str] = {}
        self.trust_remote_code = trust_remote_code
        # the rows a generation may decode are the protocol's limit (the engine's own default is lower)
        self.engine_options = {"max_rows": limits.max_sequences, **(engine_options or {})}
        self.session_dir = Path(session_dir).resolve() if session_dir is not None else None
        self.compiles: queue.Queue = queue.Queue()  # Compiles not yet started, taken by COMPILERS threads
        self.compiling: dict[tuple, Compile] = {}  # key -> the compile that requests for that key join
        for number in range(COMPILERS):
            threading.Thread(target=self._compiler, daemon=True, name=f"compile-{number}").start()
        self.configures: queue.Queue = queue.Queue()  # Jobs whose processors the configuring thread configures
        threading.Thread(target=self._configurer, daemon=True, name="configure").start()
        self.engines: dict[str, Engine] = {}
        self.sessions: dict[str, tuple[str, object]] = {}  # name -> (model name, Session)
        self.queues: dict[str, deque[Job]] = {}  # session name -> jobs in arrival order
        self.forking: dict[str, Job] = {}  # a fork's new name -> its fork_session, until it runs
        self.in_flight: dict[int, Job] = {}
        self.queued_bytes = 0  # frame bytes of the jobs in flight
        self.active: list[Job] = []  # started generations, in the order they started
        self.aside: Request | None = None  # answered on a thread of its own (a load_model...): frames wait
        self._names = 0
        # in the names this server chooses: a name a client kept from an earlier server process (one its
        # supervisor has since restarted) is no session here, rather than another client's
        self._name_tag = secrets.token_hex(4)
        self.started = time.time()
        self._trim_heap = _heap_trimmer()
        self._held_peak = 0  # the most KV memory held since the heap was last trimmed
        self._trim_due = False  # an unloaded model's weights were freed since

    # ---- the loop --------------------------------------------------------------------------------

    def serve(self, inbox) -> int:
        """Serves until the input ends. The main thread holds torch's defaults (`DEFAULTS`) while it works,
        and lets go of them between ticks and while it waits, so that a model loading on the loading thread
        can build its modules (which changes the default dtype for that while)."""
        self.inbox = inbox
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._settle_heap()
        try:
            while True:
                if not self.active:
                    self._give_back_memory()
                    self.writer.flush()  # about to wait: nothing may linger in the buffer
                    inbox.wait(frames=self.aside is None)
                with DEFAULTS.using():
                    self._drain(inbox)
                    self._tick(inbox)
        except Shutdown as stop:
            return stop.status
        except OutputFailed as problem:
            log.error("cannot write to the protocol output: %s; exiting", problem)
            return 1
        except UNREACHABLE:
            log.info("the client is gone; exiting")
            return 0

    def _settle_heap(self) -> None:
        """Collects every cycle, then moves what is left to the collector's permanent generation, where its
        full collections no longer walk it: the 356,000 objects of the modules a server imports made one take
        190-220 ms, a pause of every stream, as often as requests left enough objects behind (a dfa of 20,000
        transitions is 80,000 lists). Done when serving starts, and again when an unloaded model was frozen
        (`_collect_unloaded`), which freezes the models still loaded in turn. What is frozen is still freed
        when nothing refers to it; only a cycle among objects alive now that later becomes garbage waits for
        the next such unload, if one comes."""
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    def _give_back_memory(self) -> None:
        """Hands the heap's free pages back to the system (`malloc_trim`) once the KV memory let go since the
        last time passes `TRIM_BYTES`, or an unloaded model's weights were freed: glibc keeps them otherwise, and
        the process stays at the size of its busiest moment (helper-84: 1,024 sessions closed with `cache_bytes` 0
        left it at 1.42 GB; measured here, 600 sessions' 542 MiB of caches closed left 1,013 MB, 447 MB after a
        trim of 44 ms). Done as the server goes idle, where the pause holds up nothing that runs."""
        held = self._held_bytes()
        if self._trim_heap is not None and (self._trim_due or self._held_peak - held >= TRIM_BYTES):
            self._trim_heap(0)
            self._trim_due, self._held_peak = False, held

    def _held_bytes(self) -> int:
        """The KV memory every model holds now, noted as the most held since the last trim."""
        held = sum(engine.store.used_bytes for engine in self.engines.values())
        self._held_peak = max(self._held_peak, held)
        return held

    def _collect_unloaded(self, model: weakref.ref) -> None:
        """Frees an unloaded model now, where nothing holds its engine any more (see `_tick`): an engine is a
        web of cycles (its scheduler and store refer back to it), so its memory, gigabytes for a real model,
        came back only at some later full collection (measured: 1-2 more copies of a 200 MB model held
        across load and unload cycles), or never, for a frozen model. A collection of what is not frozen, a
        few milliseconds, frees a model loaded since the heap was last frozen; a model that was loaded then
        (the startup model, or one loaded before an earlier unload of a frozen model) takes a walk of the
        whole heap (0.15-0.2 s)."""
        gc.collect()
        if model() is not None:
            self._settle_heap()
            if model() is not None:  # a defect of ours holds it: say so, since its memory stays
                log.warning("an unloaded model is still referred to; its memory is not freed")
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # give a model's device memory back to the device, not to our allocator's pool
        self._trim_due = True

    def _tick(self, inbox) -> None:
        """A tick of each busy engine, each followed by what it produced and what arrived meanwhile. No frame
        holds an engine while requests are handled: an unload among them collects its engine at once."""
        for name in list(self.engines):
            if self._tick_engine(name):
                self._held_bytes()  # a generation's rows may hold more than any idle moment shows
                self._deliver()
                self._drain(inbox)

    def _tick_engine(self, name: str) -> bool:
        """Ticks the model of that name if it is still loaded and busy; whether it did."""
        engine = self.engines.get(name)
        if engine is None or not engine.scheduler.busy:
            return False
        engine.scheduler.tick()
        return True

    def _drain(self, inbox) -> None:
        """Handles what the inbox holds: notices, and frames unless a request is answered aside (a load_model:
        the frames after it are read once it has replied)."""
        while True:
            try:
                item = inbox.get(frames=self.aside is None)
            except queue.Empty:
                return
            if item is EOF_MARK:
                log.info("input closed; cancelling %d request(s) and exiting", len(self.in_flight))
                self._cancel_all(reply=False)
                raise Shutdown(0)
            if isinstance(item, OversizedFrame):
                self.writer.send(oversized_frame_reply(item, self.limits.max_frame_bytes, self.in_flight))
            elif isinstance(item, Compiled):
                self._compiled(item.compile)
            elif isinstance(item, Configured):
                self._configured(item.job)
            elif isinstance(item, Loaded):
                self._loaded(item)
            elif isinstance(item, Answered):
                self.aside = None
                self.writer.send(item.reply)
            else:
                self.handle_payload(item)

    def handle_payload(self, payload: bytes) -> None:
        message = None
        try:
            message = unpack(payload, self.limits.max_depth, self.limits.max_values)
            rid = request_id_of(message)
            if rid in self.in_flight:  # before anything else: any other error would settle the request in flight
                raise duplicate_id(rid)
            self.dispatch(parse_request(message, self.limits), payload)
        except ProtocolError as problem:
            rid = problem.request_id
            if rid in self.in_flight and problem.code != codes.DUPLICATE_ID:  # read from a payload that did not decode
                problem = duplicate_id(rid)
            self.writer.send(problem_reply(rid, problem))
        except SidecarError as problem:
            self.writer.send(problem_reply(request_id_of(message), problem))
        except (Shutdown, *UNREACHABLE):
            raise
        except Exception as bug:  # a defect of ours: report it on this request, keep serving the others
            self.writer.send(internal_reply(request_id_of(message), bug))

    # ---- dispatch --------------------------------------------------------------------------------

    def dispatch(self, request: Request, payload: bytes) -> None:
        size = len(payload)
        if request.op in SESSION_OPS:
            if len(self.in_flight) >= self.limits.max_in_flight:
                raise ProtocolError(codes.TOO_MANY_REQUESTS, f"{self.limits.max_in_flight} requests in flight (max_in_flight)",
                                    request.id, limit="max_in_flight", max=self.limits.max_in_flight,
                                    value=len(self.in_flight) + 1)
            if self.queued_bytes + size > self.limits.max_queued_bytes:
                raise self.limits.exceeded("max_queued_bytes", self.queued_bytes + size, request.id)
            name = request.params["session"]
            if not self._taken(name):
                raise ProtocolError(codes.UNKNOWN_SESSION, f"no open session {name!r}", request.id, session=name)
            job = Job(request, size, frame=payload)
            if request.op == "fork_session" and request.params["new"] is not None:
                self._reserve(request.params["new"], job)
            self.in_flight[request.id] = job
            self.queued_bytes += size
            self.queues[name].append(job)
            self._advance(name)
            if job.generation is None and self.in_flight.get(request.id) is job:  # it waits: keep its frame only
                job.request, job.shelved = slim(request), True
            return
        if request.op == "load_model":
            self._start_load(request)
            return
        handler = getattr(self, f"op_{request.op}")
        if _large_input(request):
            self._answer_aside(request, handler)
            return
        self.writer.send(ok(request.id, handler(request.params, request.id)))

    def _answer_aside(self, request: Request, handler) -> None:
        """Answers a tokenize or detokenize of a large input on a thread of its own, as a load_model is: the
        generations under way go on, and the frames after it wait until its reply is sent. Nothing it reads
        can change meanwhile (no unload_model is read)."""
        def answer():
            try:
                reply = ok(request.id, handler(request.params, request.id))
            except (ProtocolError, SidecarError) as problem:
                reply = problem_reply(request.id, problem)
            except Exception as bug:  # a defect of ours, on this request alone
                reply = internal_reply(request.id, bug)
            self.inbox.notify(Answered(request, reply))

        threading.Thread(target=answer, daemon=True, name=request.op).start()
        self.aside = request

    def _advance(self, name: str) -> None:
        """Starts whatever is at the head of a session's queue, unless a generation is running there.

        A request that fails to start is answered and retired here, so it can never block its queue. A fork
        that ran lets what was sent to its session go on: those sessions are advanced in turn, not by
        recursion (a client may pipeline a chain of a thousand forks, each of the one before).
        """
        names = [name]
        while names:
            name = names.pop()
            if name in self.forking:
                continue  # the fork that creates this session has not run yet
            jobs = self.queues.get(name)
            while jobs and jobs[0].generation is None:
                job = jobs[0]
                try:
                    if job.request.op == "generate":
                        if not job.compiled and self._compile_first(name, job):
                            break  # the session waits for its constraints; the other sessions go on
                        if self._prepare_first(name, job):
                            break  # and for its input, if large
                        self._decode(job)
                        self._start_generation(job)
                        job.request = slim(job.request)  # the generation holds what it needs of it
                        break
                    self._decode(job)
                    reply = ok(job.request.id, getattr(self, f"op_{job.request.op}")(job.request.params, job.request.id))
                except (ProtocolError, SidecarError) as problem:
                    reply = problem_reply(job.request.id, problem)
                except (Shutdown, *UNREACHABLE):
                    raise
                except Exception as bug:
                    reply = internal_reply(job.request.id, bug)
                self._retire(job, reply)
                if job.request.op == "fork_session" and job.request.params["new"] in self.queues:
                    names.append(job.request.params["new"])  # what was sent to the fork while it waited
                jobs = self.queues.get(name)  # close_session removes the queue

    def _full_request(self, job: Job) -> Request:
        """A job's request as it arrived: decoded again from its frame if it is shelved."""
        return self._decoded_frame(job) if job.shelved else job.request

    def _decoded_frame(self, job: Job) -> Request:
        return parse_request(unpack(job.frame, self.limits.max_depth, self.limits.max_values), self.limits)

    def _decode(self, job: Job) -> None:
        """The job starts: from now on it holds its request decoded, and no longer its frame."""
        request = job.prepared or self._full_request(job)
        job.request, job.frame, job.shelved, job.prepared = request, None, False, None

    def _compile_first(self, name: str, job: Job) -> bool:
        """Configures a generation's processors (on the configuring thread when they are large), then starts
        compiling its constraints that no earlier call compiled, on other threads, so that the loop goes on
        ticking the other sessions meanwhile (a large vocabulary takes a second or more). A constraint
        already being compiled for another request is waited for, not compiled again. True while the job
        must wait."""
        if job.compiles or job.configuring:
            return True
        _, session = self._session(name, job.request.id)
        vocabulary = session.engine.vocabulary
        if job.configure_failure is not None:
            raise job.configure_failure
        if job.processors is None:
            params = self._full_request(job).params
            specs = params["processors"]
            # the model's, with the fields the call changes (refused beside processors given): within the limits
            defaults = session.engine.defaults_for(params["generation_config"], specs is not None,
                                                   params["strategy"]).describe()
            if specs is None or params["stop"] is None:
                check_params("generate", {"processors": None if specs is not None else
                                          defaults["processors"] + defaults["sampling_processors"],
                                          "stop": defaults["stop"] if params["stop"] is None else None},
                             self.limits, job.request.id)
            if specs is None:  # the model's own, which compile nothing: the engine makes them from its config
                if params["eos_token_ids"] is not None:  # which they take: named as validate names them
                    session.engine.check_token_ids(params["eos_token_ids"], "eos_token_ids")
                job.processors = []
            elif specs and len(pack(specs)) > CONFIGURE_INLINE_BYTES:
                job.configuring = True
                self.configures.put((self._configure, job))
                return True
            else:
                job.processors = configured(specs, job.request.id)
        for index, p in enumerate(job.processors):
            if isinstance(p, Constraint) and not p.compiled_for(vocabulary):
                key = (p.compile_key(), vocabulary.fingerprint)
                task = self.compiling.get(key)
                if task is None:
                    task = self.compiling[key] = Compile(key, p, vocabulary)
                    self.compiles.put(task)
                task.waiting[job.request.id] = job
                job.compiles.append((index, task))
        if not job.compiles:
            job.compiled = True
        return not job.compiled

    def _compiler(self) -> None:
        """A compiling thread (one of COMPILERS). A daemon: a server that exits does not wait for a compile
        (its child process is bounded in CPU time too, and dies with the fork server, which ends with this
        process)."""
        while True:
            self._compile(self.compiles.get())

    def _compile(self, task: Compile) -> None:
        """A method of its own, so that no compiling thread keeps the last task it ran (and what its
        requests refer to: their sessions, an unloaded model) while it waits for the next."""
        try:
            if task.stop.is_set():  # every request that wanted it left before it started
                raise CompileCancelled("the compile was cancelled before it started")
            task.compiled = task.constraint.compile(task.vocabulary, task.stop.is_set)
        except proc.ProcessorError as problem:  # CompileCancelled too: nobody waits to read it
            task.problem = problem
        except Exception as bug:  # a defect of ours: the generations will meet it again when they start
            log.exception("compiling constraint %s failed", task.constraint.name, exc_info=bug)
        finally:
            self.inbox.notify(Compiled(task))

    def _configurer(self) -> None:
        """The configuring thread. A daemon, like the compiling ones; it reads a job's frame, which nothing
        changes (the main thread lets go of it only once the job starts, after this thread is done with it),
        and writes its `processors` or `configure_failure` (`_configure`), or its input (`_prepare`), which the
        main thread reads once the job is in the inbox."""
        while True:
            work, *arguments = self.configures.get()
            work(*arguments)
            del work, arguments  # or the thread keeps the last job (its generation, an unloaded model) while it waits

    def _configure(self, job: Job) -> None:
        """A method of its own, so that the configuring thread does not keep the last job (its generation,
        its session, an unloaded model) while it waits for the next. The job's processors are decoded here,
        from its frame (its request may be shelved meanwhile), so that jobs waiting to be configured hold
        their frames only."""
        try:
            request = self._decoded_frame(job)
            with DEFAULTS.using():  # processors make tensors
                job.processors = configured(request.params["processors"], request.id)
        except Exception as failure:  # ProtocolError, SidecarError, or a defect of ours, answered as such
            job.configure_failure = failure
        finally:
            self.inbox.notify(Configured(job))

    def _prepare_first(self, name: str, job: Job) -> bool:
        """Makes the input of a generate of a large frame on the configuring thread (INPUT_INLINE_BYTES), once
        its constraints are compiled, right before it starts: what it holds decoded while it waits for
        compiles is bounded by its frame, as for every request that waits. True while the job must wait."""
        if job.configuring:
            return True
        if (job.input_ids is not None or job.input_failure is not None or job.problem is not None
                or job.size <= INPUT_INLINE_BYTES):
            return False
        _, session = self._session(name, job.request.id)
        job.configuring = True
        self.configures.put((self._prepare, job, _input_source(session)))
        return True

    def _prepare(self, job: Job, source: tuple) -> None:
        """On the configuring thread: the job's request decoded from its frame, and its input made from it
        (`_input_ids`). Its session runs nothing else meanwhile, so the last result a `continue` reads is
        that of the call before it."""
        try:
            job.prepared = self._decoded_frame(job)
            job.input_ids = _input_ids(*source, job.prepared.params)
        except Exception as failure:  # raised when it starts, where the input's checks come (a defect of ours too)
            job.input_failure = failure
        finally:
            self.inbox.notify(Configured(job))

    def _configured(self, job: Job) -> None:
        """On the main thread, a job's processors are configured, or its input made: it goes on, unless it was
        answered meanwhile (cancelled, or its session closed)."""
        job.configuring = False
        if self.in_flight.get(job.request.id) is job:
            self._advance(job.request.params["session"])  # it waits at the head of that session's queue

    def _compiled(self, task: Compile) -> None:
        """On the main thread, a compile is over: the generations it held that need nothing else go on."""
        task.done = True
        self._forget(task)
        self._forget_vocabulary_if_unused(task.vocabulary.fingerprint)  # its models may be unloaded by now
        for job in list(task.waiting.values()):
            if job.request.id in self.in_flight and self._settled(job):
                self._advance(job.request.params["session"])  # it waits at the head of that session's queue

    def _settled(self, job: Job) -> bool:
        """Whether a job is done waiting: every compile it waits for is over, or the first failure in
        processor order is known (the error it would have met compiling them one by one). Then it leaves
        the compiles still running, which stop if nobody else waits for them."""
        for index, task in job.compiles:
            if not task.done:
                return False
            if task.problem is not None:
                job.problem = InvalidProcessor(f"processors[{index}] ({task.constraint.name}): {task.problem}",
                                               index=index)
                break
        else:  # binding takes what was compiled, which the compile cache may have evicted since
            for index, task in job.compiles:
                if task.compiled is not None:  # None: a defect of ours, which binding meets again
                    job.processors[index] = job.processors[index].with_compiled(task.vocabulary, task.compiled)
        self._release(job)
        job.compiled = True
        return True

    def _release(self, job: Job) -> None:
        """The job waits for its compiles no more (it is done with them, cancelled, or its session is gone):
        a compile still running that no other request waits for is stopped, its child killed."""
        for _, task in job.compiles:
            if task.waiting.pop(job.request.id, None) is not None and not task.waiting and not task.done:
                task.stop.set()
                self._forget(task)  # a later request for the key starts a compile of its own
        job.compiles = []

    def _forget(self, task: Compile) -> None:
        """Takes a compile out of the table that requests for its key join (it may have been replaced)."""
        if self.compiling.get(task.key) is task:
            del self.compiling[task.key]

    def _start_generation(self, job: Job) -> None:
        if job.problem is not None:
            raise job.problem
        p = job.request.params
        _, session = self._session(p["session"], job.request.id)
        if p["chat_template"] is not None and p["chat_template"] not in session.engine.chat_templates:
            names = ", ".join(session.engine.chat_templates) or "none"
            raise InvalidArgument(f"the model has no chat template named {p['chat_template'][:64]!r} (it has: {names}); "
                                  "over the protocol a template is named, never sent", option="chat_template")
        if sum(p[name] is not None for name in ("prompt", "token_ids", "messages", "continue")) != 1:
            raise InvalidArgument("give exactly one input: prompt, token_ids, messages or continue", option="prompt")
        if job.input_failure is not None:
            raise job.input_failure
        input_ids = _input_ids(*_input_source(session), p) if job.input_ids is None else job.input_ids
        job.input_ids = None  # the generation holds them now
        max_new_tokens = p["max_new_tokens"]
        if max_new_tokens is None:
            # the model's, or the call's generation_config's, unmeasured by the parse (the engine fits the model's
            # to the context)
            max_new_tokens = session.engine.defaults_for(p["generation_config"]).max_new_tokens
            if max_new_tokens > self.limits.max_new_tokens:
                param = "generation_config" if "max_new_tokens" in (p["generation_config"] or {}) else "max_new_tokens"
                raise self.limits.exceeded("max_new_tokens", max_new_tokens, job.request.id, param=param)
        self._check_logprobs_fit(job.request.id, p, max_new_tokens, len(input_ids), session.engine.vocab_size)
        job.generation = session.stream(
            token_ids=input_ids, max_new_tokens=p["max_new_tokens"], strategy=p["strategy"], seed=p["seed"],
            processors=None if p["processors"] is None else job.processors,  # None: the model's, made by the engine
            stop=p["stop"], eos_token_ids=p["eos_token_ids"], generation_config=p["generation_config"],
            num_samples=p["num_samples"], num_beams=p["num_beams"],
            num_return_sequences=p["num_return_sequences"], length_penalty=p["length_penalty"],
            early_stopping=p["early_stopping"], logprobs=p["logprobs"], prompt_logprobs=p["prompt_logprobs"],
            reuse=p["reuse"], keep=p["keep"],
        )
        rid = job.request.id  # not the job: its generation would hold it in a cycle
        job.generation.accept_result = lambda result: self._check_reply_fits(rid, result)
        self.active.append(job)

    def _check_logprobs_fit(self, rid: int, p: dict, max_new_tokens: int, prompt: int, vocab_size: int) -> None:
        """Refuses, before any work, log-probabilities whose reply could not fit in a frame: with `logprobs`,
        were every row (sample or beam) to reach max_new_tokens, for each row and again for the first at the
        top of the reply; with `prompt_logprobs`, for each prompt token, with the prompt's ids. A token's k + 1
        log-probabilities (float64s), its id and its k pairs' at the vocabulary's widest, and the pairs' and
        its list's headers (the text and the rest are weighed at the end, as for any reply). What the run
        holds meanwhile is bounded with it. A k past 20 is the engine's to refuse."""
        id_bytes = len(pack(vocab_size - 1))  # msgpack's width of the largest id: 1, 2, 3 or 5 bytes

        def per_token(k: int) -> int:  # k + 1 float64s, and k + 1 ids and list headers
            return (9 + id_bytes + 1) * (k + 1)

        asked = {}  # option: (bytes, what)
        if p["logprobs"] is not None and p["logprobs"] <= MAX_LOGPROBS:
            k = p["logprobs"]
            rows = (p["num_beams"] or DEFAULT_NUM_BEAMS) if p["strategy"] == "beam" else (p["num_samples"] or 1)
            asked["logprobs"] = ((rows + 1) * max_new_tokens * per_token(k),
                                 f"logprobs {k} over {rows} row(s) each reaching max_new_tokens {max_new_tokens}")
        if p["prompt_logprobs"] is not None and p["prompt_logprobs"] <= MAX_LOGPROBS:
            k = p["prompt_logprobs"]
            asked["prompt_logprobs"] = (prompt * (per_token(k) + id_bytes),  # and the prompt's ids
                                        f"prompt_logprobs {k} over a prompt of {prompt} tokens")
        least = sum(size for size, _ in asked.values())
        if least > self.limits.max_frame_bytes:
            raise ProtocolError(codes.LIMIT_EXCEEDED, f"{' and '.join(what for _, what in asked.values())} would take "
                                f"{least} bytes of the reply, over the limit max_frame_bytes = "
                                f"{self.limits.max_frame_bytes}: ask for fewer tokens, rows or log-probabilities", rid,
                                limit="max_frame_bytes", max=self.limits.max_frame_bytes, value=least,
                                param=max(asked, key=lambda option: asked[option][0]))

    def _check_reply_fits(self, rid: int, result) -> None:
        """Refuses a result whose reply would not fit in a frame, before the session keeps it: the reply is
        then `limit_exceeded` and, as for any failed request, the session is as it was (its history, its
        cache and the last result a `continue` reads)."""
        size = len(pack(result_reply(rid, result)))
        if size > self.limits.max_frame_bytes:
            raise ReplyTooLarge(f"the reply would be {size} bytes, over the limit max_frame_bytes = "
                                f"{self.limits.max_frame_bytes}; the session is as it was before the request",
                                limit="max_frame_bytes", max=self.limits.max_frame_bytes, value=size)

    def _deliver(self) -> None:
        """Sends what the last tick produced: token events, and the replies of generations that ended."""
        for job in list(self.active):
            generation = job.generation
            events = generation.take_events()
            if events and job.request.params["stream"]:
                tagged = generation.request.num_samples > 1
                for token in events:
                    first = not job.streamed
                    job.streamed = True
                    fields = {"sequence": token.sequence} if tagged else {}
                    if token.logprob is not None:
                        fields["logprob"], fields["top_logprobs"] = token.logprob, token.top_logprobs
                    # the first token goes out at once (time to first token); later ones may be coalesced
                    self.writer.send(event(job.request.id, "token", token_ids=[token.token_id], text=token.text, **fields),
                                     urgent=first)
            if generation.done:
                problem = generation.error
                if problem is None:
                    self._finish(job, generation_reply(job))
                elif isinstance(problem, SidecarError):
                    self._finish(job, problem_reply(job.request.id, problem))
                else:
                    self._finish(job, internal_reply(job.request.id, problem))

    def _retire(self, job: Job, reply: dict | None) -> None:
        """Takes a job out of every table and sends its reply (a fork that did not run first answers what
        waited for the session it was to create)."""
        if self.in_flight.pop(job.request.id, None) is not None:
            self.queued_bytes -= job.size
        self._release(job)
        if self.forking.get(job.request.params.get("new")) is job:
            self._unreserve(job, answer=reply is not None)
        if job in self.active:
            self.active.remove(job)
        jobs = self.queues.get(job.request.params.get("session"))
        if jobs and job in jobs:
            jobs.remove(job)
        if reply is not None:
            self.writer.send(reply)

    def _finish(self, job: Job, reply: dict | None) -> None:
        """Retires a job and starts what waits behind it in its session."""
        self._retire(job, reply)
        name = job.request.params.get("session")
        if name in self.queues:
            self._advance(name)

    def _cancel(self, job: Job) -> None:
        """Cancels one request and starts what waits behind it."""
        self._finish(job, cancelled_reply(job))

    def _cancel_all(self, reply: bool) -> None:
        """Cancels everything, starting nothing: the server is about to exit."""
        self.forking.clear()  # what waits for a fork is cancelled with the rest
        for job in list(self.in_flight.values()):
            self._retire(job, cancelled_reply(job) if reply else None)

    # ---- lookups ---------------------------------------------------------------------------------

    def _engine(self, name: str, rid: int) -> Engine:
        engine = self.engines.get(name)
        if engine is None:
            loaded = ", ".join(self.engines) or "none"
            raise ProtocolError(codes.UNKNOWN_MODEL, f"no model named {name!r} is loaded (loaded: {loaded})", rid, model=name)
        return engine

    def _session(self, name: str, rid: int):
        entry = self.sessions.get(name)
        if entry is None:
            raise ProtocolError(codes.UNKNOWN_SESSION, f"no open session {name!r}", rid, session=name)
        return entry

    # ---- ops: each returns the result map of its ok reply ----------------------------------------

    def op_hello(self, params, rid):
        return {
            "protocol_version": PROTOCOL_VERSION,
            "server": "beam-sidecar",
            "server_version": __version__,
            "capabilities": {"ops": list(OPS), "processors": sorted(proc.BUILTINS), "stream": True, "cancel": True,
                             "strategies": list(STRATEGIES), "trust_remote_code": self.trust_remote_code},
            "processor_options": {name: [{k: o[k] for k in ("name", "required", "default", "schema", "doc")} for o in options]
                                  for name, options in proc.catalogue().items()},
            # the protocol's limits, and the three the processors keep for the whole process
            "limits": {**self.limits.as_dict(), "constraint_budget_bytes": budget.budget_bytes(),
                       "constraint_cache_bytes": structured_compile.cache_bytes(), "grammar_step_ms": grammar.step_limit_ms()},
            "models": list(self.engines),
        }

    def op_ping(self, params, rid):
        return {}

    def allow_path(self, path: str) -> None:
        """Lets `load_model` load this directory whatever the model roots (the operator named it)."""
        self.allowed_paths.add(Path(path).resolve())

    def use_chat_template(self, engine: Engine, template: str) -> None:
        """Makes `template` the chat template of `engine` and of every later load of the model directory it
        was loaded from (the CLI's --chat-template, for the startup model)."""
        self.operator_templates[_directory(engine)] = engine.tokenizer.chat_template = template

    def load_model(self, params: dict) -> dict:
        """Loads a model here and now, as a load_model with these params would: the CLI's startup model, before
        serving. Returns its model info. What `params` leaves out takes its protocol default."""
        params = {key: param.default for key, param in OPS["load_model"].items()} | params
        engine = Engine.load(**self._load_arguments(params, None))
        return self._add_model(params["name"], engine)

    def _start_load(self, request: Request) -> None:
        """Checks a load_model and starts loading its model on a thread of its own: the generations under way
        go on meanwhile (a real model takes seconds to minutes to read), and the frames after it wait in the
        inbox until `_loaded` has answered it, so that what a client sends after a load_model still finds it
        answered. Until then no other op can change `engines`."""
        arguments = self._load_arguments(request.params, request.id)
        threading.Thread(target=self._load, args=(request, arguments), daemon=True, name="load").start()
        self.aside = request  # once the thread runs, so that a failure to start one holds no frame back

    def _load_arguments(self, params: dict, rid) -> dict:
        """`Engine.load`'s arguments for a load_model, once checked against the models loaded and the limits."""
        name = params["name"]
        if name == "":
            raise InvalidArgument('name must be a name of at least one character, or left out for "default"',
                                  option="name")
        if params["path"] == "":  # Path("") is the working directory: a client's unset variable, not a choice
            raise InvalidArgument("path must be a path of at least one character, or nil for the embedded model",
                                  option="path")
        if name in self.engines:
            raise ProtocolError(codes.MODEL_EXISTS, f"a model named {name!r} is already loaded", rid, model=name)
        if len(self.engines) >= self.limits.max_models:
            raise self.limits.exceeded("max_models", len(self.engines) + 1, rid)
        self._check_load_allowed(params, rid)
        options = dict(self.engine_options)
        if params["device"] is not None:
            options["device"] = params["device"]
        if params["prefill_chunk"] is not None:
            options["prefill_chunk"] = self._prefill_chunk(params["prefill_chunk"], rid)
        return {"path": params["path"], "dtype": params["dtype"], "trust_remote_code": params["trust_remote_code"],
                **options}

    def _prefill_chunk(self, chunk: int, rid) -> int:
        """A model's own chunk, at most the server's: smaller lets a large model's prompts hold the other models'
        streams for less time each tick; never larger, since a pass's memory grows with it (its attention
        scores, chunk x context) and the operator's flag bounds it. (`Engine.load` refuses 0 before it loads.)"""
        most = self.engine_options.get("prefill_chunk", DEFAULT_PREFILL_CHUNK)
        if chunk > most:
            raise ProtocolError(codes.LIMIT_EXCEEDED, f"prefill_chunk {chunk} is over the server's prefill chunk of "
                                f"{most} tokens (--prefill-chunk), which bounds a model's own", rid,
                                limit="prefill_chunk", max=most, value=chunk)
        return chunk

    def _load(self, request: Request, arguments: dict) -> None:
        """The loading thread. A daemon: a server whose input ends does not wait for a load."""
        try:
            engine = Engine.load(**arguments)
        except BaseException as failure:  # typed, a defect of ours, or a model's code exiting: answered all the same
            self.inbox.notify(Loaded(request, failure=failure))
        else:
            self.inbox.notify(Loaded(request, engine))

    def _loaded(self, loaded: Loaded) -> None:
        """On the main thread, a load_model is over: its reply, then the frames that waited behind it."""
        self.aside = None
        rid, failure = loaded.request.id, loaded.failure
        if failure is None:
            try:
                reply = ok(rid, self._add_model(loaded.request.params["name"], loaded.engine))
            except Exception as bug:  # a defect of ours, on this request alone, as `handle_payload` has it
                failure = bug
        if failure is not None:  # what a load read before it failed (weights, say) is freed: given back once idle
            self._trim_due = True
        if isinstance(failure, (ProtocolError, SidecarError)):
            reply = problem_reply(rid, failure)
        elif failure is not None:
            reply = internal_reply(rid, failure)
        self.writer.send(reply)

    def _add_model(self, name: str, engine: Engine) -> dict:
        """Serves `engine` as `name`; its model info (made first: a model whose info fails is not served)."""
        if _directory(engine) in self.operator_templates:
            engine.tokenizer.chat_template = self.operator_templates[_directory(engine)]
        info = model_info(name, engine)
        self.engines[name] = engine
        return info

    def _check_load_allowed(self, params, rid) -> None:
        if params["trust_remote_code"] and not self.trust_remote_code:
            raise ProtocolError(codes.FORBIDDEN, "trust_remote_code is refused: the server was not started with "
                                "--trust-remote-code", rid, param="trust_remote_code")
        if params["path"] is None:  # the embedded model ships with the server
            return
        try:
            path = Path(params["path"]).resolve()
        except (ValueError, OSError, RuntimeError) as problem:  # a NUL byte; a loop of symbolic links (RuntimeError)
            raise InvalidArgument(f"path is not a usable file system path: {problem}", option="path") from problem
        if path in self.allowed_paths or any(path.is_relative_to(root) for root in self.model_roots):
            return
        roots = ", ".join(map(str, self.model_roots)) or "none"
        raise ProtocolError(codes.FORBIDDEN, f"{params['path']!r} is outside the model roots the server was started "
                            f"with (--model-root: {roots})", rid, param="path")

    def op_unload_model(self, params, rid):
        unloaded, closed = self._drop_model(params["model"], rid)
        self._collect_unloaded(unloaded)  # the reply means its memory is back
        return {"closed_sessions": closed}  # so that a client forgets what it knew of them (an owner, say)

    def _drop_model(self, name: str, rid: int) -> tuple[weakref.ref, list[str]]:
        """Closes a model's sessions and forgets it, and what was compiled over its vocabulary if no other model
        has it; returns a weak reference to the model and the sessions closed, sorted. A function of its own,
        so that no local of it outlives it."""
        engine = self._engine(name, rid)
        unloaded, fingerprint = weakref.ref(engine.model), engine.vocabulary.fingerprint
        closed = sorted(session_name for session_name, (model, _) in self.sessions.items() if model == name)
        for session_name in closed:
            self._close(session_name)
        del self.engines[name]
        self._forget_vocabulary_if_unused(fingerprint)
        return unloaded, closed

    def _forget_vocabulary_if_unused(self, fingerprint: str) -> None:
        """Drops what is kept for constraints over a vocabulary (`forget_vocabulary`) once no loaded model has
        it: at the unload of its last model, and when a compile over it ends after that (an llguidance parser
        is built to its end, and stored, even when nobody waits for it any more)."""
        if all(e.vocabulary.fingerprint != fingerprint for e in self.engines.values()):
            forget_vocabulary(fingerprint)

    def op_models(self, params, rid):
        return {"models": [model_info(name, engine) for name, engine in self.engines.items()]}

    def op_open_session(self, params, rid):
        engine = self._engine(params["model"], rid)
        name = self._claim_session_name(params["session"], rid, "session")
        self._add_session(name, params["model"], engine.session())
        return {"session": name, "model": model_info(params["model"], engine)}

    def _claim_session_name(self, name: str | None, rid: int, option: str) -> str:
        """A name for a new session: the one asked for (`option`) if it is free, else a fresh one; within
        max_sessions."""
        if name == "":
            raise InvalidArgument(f"{option} must be a name of at least one character, or left out for a name the "
                                  f"server chooses", option=option)
        if name is not None and self._taken(name):
            raise ProtocolError(codes.SESSION_EXISTS, f"a session named {name!r} is already open", rid, session=name)
        count = len(self.sessions) + len(self.forking)  # a pending fork's name counts
        if count >= self.limits.max_sessions:
            raise self.limits.exceeded("max_sessions", count + 1, rid)
        return self._fresh_session_name() if name is None else name

    def _add_session(self, name: str, model: str, session) -> None:
        self.sessions[name] = (model, session)
        self.queues.setdefault(name, deque())  # a fork's may hold what was sent to it before it ran

    def _reserve(self, name: str, fork: Job) -> None:
        """Claims a fork's new name when the fork arrives, so that requests pipelined behind it for that
        name wait for the fork in the new session's queue instead of being `unknown_session`."""
        self._claim_session_name(name, fork.request.id, "new")
        self.forking[name] = fork
        self.queues[name] = deque()

    def _unreserve(self, fork: Job, answer: bool) -> None:
        """The fork ended without creating its session: what waited for it is `unknown_session`, and so is
        what waited for the forks among those, and so on; answered deepest first (the requests an op ends
        before its own reply), without recursion (a chain of forks may be a thousand long)."""
        ended, forks = [], [fork]
        while forks:
            fork = forks.pop()
            name = fork.request.params["new"]
            del self.forking[name]
            jobs = self.queues.pop(name)
            ended.append((fork, name, jobs))
            forks += [job for job in jobs if self.forking.get(job.request.params.get("new")) is job]
        for fork, name, jobs in reversed(ended):
            for job in jobs:
                self._retire(job, problem_reply(job.request.id, ProtocolError(
                    codes.UNKNOWN_SESSION, f"session {name!r} was never created: the fork_session (request "
                    f"{fork.request.id}) that was to create it failed", job.request.id, session=name)) if answer else None)

    def op_fork_session(self, params, rid):
        model, session = self._session(params["session"], rid)
        name = params["new"] if params["new"] is not None else self._claim_session_name(None, rid, "new")
        twin = session.fork()  # it runs at the head of the source's queue: the source is idle
        self.forking.pop(name, None)
        self._add_session(name, model, twin)
        return {"session": name, "history_tokens": len(twin.history), "cached_tokens": twin.cached}

    def op_save_session(self, params, rid):
        _, session = self._session(params["session"], rid)
        path = self._saved_path(params["name"], rid)
        if not path.exists():
            count = sum(1 for _ in self.session_dir.glob("*" + SAVED_SUFFIX))
            if count >= self.limits.max_saved_sessions:
                raise self.limits.exceeded("max_saved_sessions", count + 1, rid)
        session.save(path)
        return {"name": params["name"], "history_tokens": len(session.history), "cached_tokens": session.cached,
                "bytes": path.stat().st_size}

    def op_restore_session(self, params, rid):
        engine = self._engine(params["model"], rid)
        path = self._saved_path(params["name"], rid)
        name = self._claim_session_name(params["session"], rid, "session")
        if not path.exists():
            raise InvalidSessionFile(f"no session was saved as {params['name']!r}")
        session = engine.restore(path)
        self._add_session(name, params["model"], session)
        return {"session": name, "model": model_info(params["model"], engine), "history_tokens": len(session.history),
                "cached_tokens": session.cached}

    def _saved_path(self, name: str, rid: int) -> Path:
        """Where a saved session of this name lives: clients name saved sessions, never paths."""
        if self.session_dir is None:
            raise ProtocolError(codes.FORBIDDEN, "saving and restoring sessions is off: start the sidecar with "
                                "--session-dir DIR", rid)
        if not SAVED_NAME.fullmatch(name):  # a str of the wrong value, not of the wrong type: invalid_argument
            raise InvalidArgument("a saved session's name is 1 to 128 letters, digits, '.', '_' or '-', starting with "
                                  "a letter or digit", option="name")
        return self.session_dir / (name + SAVED_SUFFIX)

    def op_close_session(self, params, rid):
        name = params["session"]
        self._close(name, closer=self.queues[name][0])  # it runs at the head of its session's queue
        return {}

    def op_session_info(self, params, rid):
        model, session = self._session(params["session"], rid)
        return {"session": params["session"], "model": model, "history_tokens": len(session.history),
                "cached_tokens": session.cached, "cache_bytes": session.cache_bytes}

    def op_cancel(self, params, rid):
        job = self.in_flight.get(params["target"])
        if job is None or job.request.op != "generate":
            return {"cancelled": False}
        self._cancel(job)
        return {"cancelled": True}

    def op_tokenize(self, params, rid):
        engine = self._engine(params["model"], rid)
        return {"token_ids": engine.tokenizer.encode(params["text"], add_special_tokens=params["add_special_tokens"])}

    def op_detokenize(self, params, rid):
        engine = self._engine(params["model"], rid)
        engine.check_token_ids(params["token_ids"])
        return {"text": engine.tokenizer.decode(params["token_ids"], skip_special_tokens=params["skip_special_tokens"],
                                                clean_up_tokenization_spaces=False)}

    def op_stats(self, params, rid):
        compiled, compiled_bytes = structured_compile.cached()
        return {"models": {name: engine.stats() for name, engine in self.engines.items()},
                "sessions": len(self.sessions), "in_flight": len(self.in_flight),
                "active_generations": len(self.active), "uptime_s": time.time() - self.started,
                "constraints": {"compiled": compiled, "compiled_bytes": compiled_bytes, "bound_bytes": budget.held_bytes()}}

    def op_shutdown(self, params, rid):
        self._cancel_all(reply=True)
        self.writer.send(ok(rid, {}))
        raise Shutdown(0)

    def _close(self, name: str, closer: Job | None = None) -> None:
        """Closes a session, first answering every other request queued on it: a running generation
        with its `cancelled` reply (it carries the tokens so far), the rest with `session_closed`."""
        _, session = self.sessions.pop(name)
        for job in self.queues.pop(name):
            if job is closer:
                continue
            if job.generation is not None:
                self._retire(job, cancelled_reply(job))
            else:
                self._retire(job, problem_reply(job.request.id, SessionClosed(
                    f"session {name!r} was closed before this request ran", session=name)))
        session.close()

    def _taken(self, name: str) -> bool:
        """Whether a session of that name is open, or a fork that creates it is on its way."""
        return name in self.sessions or name in self.forking

    def _fresh_session_name(self) -> str:
        while True:
            self._names += 1
            name = f"s{self._names}-{self._name_tag}"
            if not self._taken(name):
                return name


def _directory(engine: Engine) -> Path:
    """The model directory an engine was loaded from, as the operator's chat templates are keyed."""
    return Path(engine.path).resolve()


def _input_source(session) -> tuple:
    """What making a session's input reads: its last result (for `continue`), its model's tokenizer and
    vocabulary size. Not the session: a thread holding it through an unload_model kept the model for good."""
    return session.last, session.engine.tokenizer, session.engine.vocab_size


def _input_ids(last, tokenizer, vocab_size: int, p: dict) -> InputIds:
    """A generate's input as token ids: its prompt, messages or token ids, or what it continues, read at the
    head of its session's queue (`last`: the result of the call before it)."""
    prompt = continuation(last, **p["continue"]) if p["continue"] is not None else p["prompt"]
    return InputIds(inputs.input_ids(
        tokenizer, vocab_size, prompt, token_ids=p["token_ids"], messages=p["messages"],
        chat_template=p["chat_template"], add_generation_prompt=p["add_generation_prompt"],
        continue_final_message=p["continue_final_message"], tools=p["tools"], documents=p["documents"],
        chat_template_kwargs=p["chat_template_kwargs"]))


def _large_input(request: Request) -> bool:
    """A tokenize or detokenize whose tokenizer work would pause every stream (see INPUT_INLINE_BYTES)."""
    if request.op == "tokenize":
        return len(request.params["text"]) > INPUT_INLINE_BYTES
    return request.op == "detokenize" and len(request.params["token_ids"]) > INPUT_INLINE_BYTES


def configured(specs: list[dict], rid: int) -> list:
    """A generate's processors, configured with llguidance's checks left to their compiles (off the main thread)."""
    with llguidance_checks_deferred():
        return build_processors(specs, rid)


def build_processors(specs: list[dict], rid: int) -> list:
    built = []
    for i, spec in enumerate(specs):
        name, options = spec.get("name"), spec.get("options", {})
        if (not isinstance(name, str) or not isinstance(options, dict) or set(spec) - {"name", "options"}
                or not all(isinstance(key, str) for key in options)):
            raise ProtocolError(codes.INVALID_PARAMS, f'processors[{i}] must be {{"name": str, "options": map with string keys}}',
                                rid, param="processors", index=i)
        try:
            built.append(proc.from_name(name, options))
        except proc.ProcessorError as problem:
            raise InvalidProcessor(f"processors[{i}] ({name[:64]}): {problem}", index=i) from problem
    return built


def problem_reply(request_id: int | None, problem: ProtocolError | SidecarError) -> dict:
    return error(request_id, problem.code, problem.message, **problem.details)


def duplicate_id(rid: int, why: str = "") -> ProtocolError:
    """The error of a frame whose id a request in flight holds, whatever else is wrong with it: any other
    error under that id would read as the final reply of the request in flight."""
    return ProtocolError(codes.DUPLICATE_ID, f"request id {rid} is already in flight{why}", rid)


def internal_reply(request_id: int | None, bug: Exception) -> dict:
    """A defect of ours: logged with its traceback on stderr, reported on its request, never fatal."""
    log.error("internal error on request %s", request_id, exc_info=bug)
    return error(request_id, codes.INTERNAL, f"{type(bug).__name__}: {str(bug)[:200]}")


def oversized_frame_reply(item: OversizedFrame, limit: int, in_flight) -> dict:
    rid = peek_request_id(item.head)
    if rid in in_flight:
        return problem_reply(rid, duplicate_id(rid, " (and its frame was too large)"))
    return error(rid, codes.FRAME_TOO_LARGE,
                 f"the frame declares {item.declared} bytes, over the limit max_frame_bytes = {limit}; it was discarded",
                 limit="max_frame_bytes", max=limit, value=item.declared)


def slim(request: Request) -> Request:
    """A request with only the parameters read while it waits or runs (its input or processors may take
    megabytes decoded)."""
    return Request(request.id, request.op, {k: request.params[k] for k in SLIM_PARAMS if k in request.params})


def cancelled_reply(job: Job) -> dict:
    if job.generation is not None:
        job.generation.cancel()
        if job.generation.error is not None:  # what it had so far was refused (too large a reply)
            return problem_reply(job.request.id, job.generation.error)
        return generation_reply(job)
    if job.request.op == "generate":
        return error(job.request.id, codes.CANCELLED, "the generation was cancelled before it started", text="",
                     token_ids=[], finish_reason="cancelled", stats=asdict(Stats()))
    return error(job.request.id, codes.CANCELLED, f"the {job.request.op} request was cancelled before it ran")


def generation_reply(job: Job) -> dict:
    return result_reply(job.request.id, job.generation.result)


def result_reply(rid: int, result) -> dict:
    body = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
            "stats": asdict(result.stats), "sequences": [sequence_map(s) for s in result.sequences]}
    if result.logprobs is not None:
        body["logprobs"], body["top_logprobs"] = result.logprobs, result.top_logprobs
    if result.prompt_logprobs is not None:
        body.update(prompt_token_ids=result.prompt_token_ids, prompt_logprobs=result.prompt_logprobs,
                    prompt_top_logprobs=result.prompt_top_logprobs)
    if result.finish_reason == "cancelled":
        return error(rid, codes.CANCELLED, "the generation was cancelled", **body)
    return ok(rid, body)


def sequence_map(sequence) -> dict:
    body = {"text": sequence.text, "token_ids": sequence.token_ids, "finish_reason": sequence.finish_reason}
    if sequence.score is not None:
        body["score"] = sequence.score
    if sequence.logprobs is not None:
        body["logprobs"], body["top_logprobs"] = sequence.logprobs, sequence.top_logprobs
    return body


def model_info(name: str, engine: Engine) -> dict:
    return {"name": name, "path": str(engine.path), "architecture": type(engine.model).__name__,
            "vocab_size": engine.vocab_size, "max_context": engine.max_context, "chat_templates": engine.chat_templates,
            "device": str(engine.model.device), "dtype": str(engine.model.dtype).removeprefix("torch."),
            "eos_token_ids": sorted(engine.default_eos_token_ids), "prefill_chunk": engine.prefill_chunk,
            "generation_defaults": engine.generation_defaults.describe()}
