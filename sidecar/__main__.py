"""`python -m sidecar`: serve the port protocol on stdin/stdout or on the given file descriptors.

In stdio mode the frames go to a private duplicate of fd 1, and fd 1 itself is pointed at stderr, so
nothing any Python code prints can reach the protocol stream. Logs go to stderr.
The process never contacts a model hub: offline mode is set here, before transformers is imported.
Exit status: 0 after EOF or `shutdown`, 1 when the protocol output cannot be written (a full disk), 2 for
bad arguments or a model that fails to load at startup, 130 after SIGINT.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import argparse  # noqa: E402  (offline mode must be set before anything below can import transformers)
import dataclasses  # noqa: E402
import fcntl  # noqa: E402
import logging  # noqa: E402
import stat  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from protocol import PROTOCOL_VERSION, Limits  # noqa: E402

from . import __version__  # noqa: E402


MAX_INT = 2**63 - 1  # any number the protocol may carry (msgpack's int64) and every counter can hold
MAX_THREADS = 1024  # torch takes a C int; more threads than that is no machine's
MAX_TEMPLATE_BYTES = 1 << 20  # a --chat-template file; real models' templates take a few KiB


def _whole(low: int, high: int = MAX_INT, shown: str = "2^63-1"):
    """An argparse type: an integer in [low, high]."""
    def whole(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError
        return value
    whole.__name__ = f"integer from {low} to {shown}"
    return whole


def _milliseconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 60_000:  # NaN fails too
        raise ValueError
    return value


_milliseconds.__name__ = "number of milliseconds from 0 to 60000"


def _path(text: str) -> str:
    """An argparse type: a path the server can resolve later (a loop of symbolic links cannot be)."""
    try:
        Path(text).resolve()
    except (OSError, RuntimeError, ValueError) as problem:
        raise argparse.ArgumentTypeError(f"{text!r} is not a usable path: {problem}") from problem
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sidecar", description="Serve the sidecar's port protocol.")
    parser.add_argument("--model", type=_path, help='a local model directory loaded at startup as "default"; "default" for the embedded tiny model')
    parser.add_argument("--dtype", help="dtype of the startup model: f32 | f16 | bf16")
    parser.add_argument("--device", default="cpu",
                        help="where models run unless load_model names a device: cpu, cuda, cuda:N, mps (default cpu)")
    parser.add_argument("--chat-template", metavar="FILE",
                        help="a Jinja chat template for the startup model, used by generate's messages (replaces its own, also "
                             "when load_model loads its directory again)")
    parser.add_argument("--fds", help="IN,OUT file descriptors to serve on instead of stdin/stdout (Erlang's :nouse_stdio uses 3,4)")
    parser.add_argument("--model-root", type=_path, action="append", default=[], metavar="DIR",
                        help="load_model may load directories under DIR (repeatable); --model is always allowed")
    parser.add_argument("--session-dir", type=_path, metavar="DIR",
                        help="where save_session writes and restore_session reads saved sessions (created if missing; "
                             "without it both are refused)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let load_model run code shipped inside a model directory (off by default)")
    parser.add_argument("--cache-budget-bytes", type=_whole(1), help="KV cache budget per model (default 2 GiB)")
    parser.add_argument("--constraint-budget-bytes", type=_whole(1),
                        help="memory of the compiled constraints (tables and masks) that running generations hold "
                             "together; a generate whose constraints would pass it is refused (default 2 GiB)")
    parser.add_argument("--constraint-cache-bytes", type=_whole(0),
                        help="memory of the compiled constraints kept for later generations with the same constraint, "
                             "the least recently used dropped first; the last compiled is always kept (default 512 MiB)")
    parser.add_argument("--grammar-step-ms", type=_whole(1),
                        help="most time the grammar constraints of one generation may take in one step (every "
                             "row's token and mask); a generation whose grammars take longer stops with "
                             "limit_exceeded (default 100)")
    parser.add_argument("--prefill-chunk", type=_whole(1), help="tokens per prefill forward pass (default 512)")
    parser.add_argument("--threads", type=_whole(1, MAX_THREADS, str(MAX_THREADS)),
                        help="threads of each forward pass (default torch's, one per physical core); on a machine whose cores "
                             "other work uses too (the BEAM's schedulers), fewer keep every step's time steady")
    parser.add_argument("--no-share-prefixes", dest="share_prefixes", action="store_false",
                        help="each session reuses only its own cache (by default a session continues a prefix, "
                             "such as a system prompt, that another session's cache holds)")
    parser.add_argument("--stream-interval-ms", type=_milliseconds, default=10.0,
                        help="token events may be held this long and written together (default 10; 0 writes each at once)")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="what goes to stderr (default INFO)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__} (protocol {PROTOCOL_VERSION})")
    parser.add_argument("--stderr", help="send this process's stderr (logs, stray writes) to PATH, e.g. a FIFO the client reads")
    limits = parser.add_argument_group("limits (each reported in hello's limits, and named in the error it causes)")
    for name, doc in Limits.docs().items():
        least = "; at least 65536, for hello's reply, errors and token events" if name == "max_frame_bytes" else ""
        limits.add_argument(f"--{name.replace('_', '-')}", type=_whole(0), default=getattr(Limits(), name), metavar="N",
                            help=f"{doc} (default %(default)s{least})")
    args = parser.parse_args(argv)
    for flag in ("model", "dtype", "chat_template", "session_dir", "stderr", "fds"):  # "" is not "not given"
        if getattr(args, flag) == "":
            parser.error(f"--{flag.replace('_', '-')} is empty: give a value, or leave the flag out")
    if "" in args.model_root:  # the working directory, which load_model could then load anything under
        parser.error("--model-root is empty: give a directory")
    if args.fds:
        try:
            args.fds = tuple(int(x) for x in args.fds.split(","))
            assert len(args.fds) == 2
        except (ValueError, AssertionError):
            parser.error("--fds takes two descriptors: IN,OUT")
        for fd, mode, way in zip(args.fds, (os.O_RDONLY, os.O_WRONLY), ("read", "written")):
            problem = _descriptor_problem(fd, mode)
            if problem:
                parser.error(f"--fds: descriptor {fd} {problem}; it must be open to be {way}")
    else:  # a closed stdout was a traceback from its duplication; a closed stdin, served as the copy of stdout
        for fd, mode, name, way in ((0, os.O_RDONLY, "stdin", "read"), (1, os.O_WRONLY, "stdout", "written")):
            problem = _descriptor_problem(fd, mode)
            if problem:
                parser.error(f"{name} (descriptor {fd}) {problem}; the protocol is served on stdin and stdout, so it "
                             f"must be open to be {way} (or give --fds IN,OUT)")
    for flag in ("chat_template", "dtype"):
        if getattr(args, flag) and not args.model:
            parser.error(f"--{flag.replace('_', '-')} applies to the startup model: give --model too")
    try:
        args.limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    except ValueError as problem:
        parser.error(str(problem))
    if args.limits.max_frame_bytes < 65536:
        parser.error("--max-frame-bytes must be at least 65536: hello's reply, error replies and token events must fit")
    if args.session_dir:
        try:
            os.makedirs(args.session_dir, exist_ok=True)
        except OSError as problem:
            parser.error(f"--session-dir: cannot create {args.session_dir}: {problem.strerror}")
    return args


def _descriptor_problem(fd: int, mode: int) -> str | None:
    """What keeps `fd` from serving in `mode` (O_RDONLY: reading, O_WRONLY: writing), None if nothing."""
    if not 0 <= fd < 2**31:
        return "is not a descriptor number"
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        return "is not open"
    if flags & os.O_ACCMODE not in (mode, os.O_RDWR):
        return "is open the other way"
    return None


def _open_stderr(path: str) -> int:
    """The descriptor to send stderr to. A FIFO is opened without waiting for a reader: with none (its
    reader gone, or never there), startup fails at once instead of blocking before it serves."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o600)
    os.set_blocking(fd, True)
    return fd


def _read_template(path: str) -> str:
    """A --chat-template file's text: a regular file of at most MAX_TEMPLATE_BYTES, in UTF-8, not blank."""
    # not blocking: opening a FIFO waits for a writer, and the start hung there, before the check below
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file")
        data = file.read(MAX_TEMPLATE_BYTES + 1)
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ValueError(f"it is larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"it is not UTF-8 text (byte {error.start})") from None
    if not text.strip():  # the model would be left with no template at all: a traceback from the check, before
        raise ValueError("it is empty")
    return text


def protocol_fds(fds) -> tuple[int, int]:
    """The descriptors to serve on; in stdio mode, fd 1 is handed to stderr and frames use a private copy."""
    if fds:
        in_fd, out_fd = fds
    else:
        in_fd, out_fd = 0, os.dup(1)
        os.dup2(2, 1)
    sys.stdout = sys.stderr
    return in_fd, out_fd


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.stderr:
        try:
            os.dup2(_open_stderr(args.stderr), 2)
        except OSError as problem:
            print(f"python -m sidecar: error: --stderr: cannot open {args.stderr}: {problem.strerror}", file=sys.stderr)
            return 2
    in_fd, out_fd = protocol_fds(args.fds)
    logging.basicConfig(stream=sys.stderr, level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    template = None
    if args.chat_template:  # read before torch and the model load: a typo fails in milliseconds, not seconds
        try:
            template = _read_template(args.chat_template)
        except OSError as problem:
            logging.getLogger("sidecar").error("cannot read --chat-template %s: %s", args.chat_template, problem.strerror)
            return 2
        except ValueError as problem:
            logging.getLogger("sidecar").error("cannot use --chat-template %s: %s", args.chat_template, problem)
            return 2
    from transformers.utils import logging as transformers_logging

    # transformers logs on a handler of its own: quieter with the level, never chattier than its warnings
    transformers_logging.set_verbosity(max(logging.WARNING, logging.getLevelName(args.log_level)))
    import torch

    from . import chat
    from .errors import SidecarError
    from .models import resolve_device
    from .server import Server
    from .transport import FrameReader, FrameWriter, InputClosed

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.constraint_budget_bytes is not None:
        from processors.structured import budget

        budget.set_budget_bytes(args.constraint_budget_bytes)
    if args.constraint_cache_bytes is not None:
        from processors.structured import compile as structured_compile

        structured_compile.set_cache_bytes(args.constraint_cache_bytes)
    if args.grammar_step_ms is not None:
        from processors.structured import grammar

        grammar.set_step_limit_s(args.grammar_step_ms / 1000)
    engine_options = {k: v for k, v in (("cache_budget_bytes", args.cache_budget_bytes), ("prefill_chunk", args.prefill_chunk)) if v is not None}
    engine_options["share_prefixes"] = args.share_prefixes
    try:
        engine_options["device"] = str(resolve_device(args.device))
    except SidecarError as problem:
        logging.getLogger("sidecar").error("--device: %s", problem.message)
        return 2
    closed = InputClosed()
    writer = FrameWriter(out_fd, max_frame_bytes=args.limits.max_frame_bytes, closed=closed,
                         coalesce_s=args.stream_interval_ms / 1000)
    server = Server(writer, limits=args.limits, model_roots=args.model_root, trust_remote_code=args.trust_remote_code,
                    engine_options=engine_options, session_dir=args.session_dir)
    if args.model:
        path = None if args.model == "default" else args.model
        if path is not None:
            server.allow_path(path)
        try:
            server.load_model({"name": "default", "path": path, "dtype": args.dtype, "device": None,
                                  "trust_remote_code": False})
        except SidecarError as problem:
            logging.getLogger("sidecar").error("cannot load --model %s: %s (%s)", args.model, problem.message, problem.code)
            return 2
        if template is not None:
            engine = server.engines["default"]
            try:
                server.use_chat_template(engine, template)
                chat.check_template(engine.tokenizer)
            except ValueError as problem:
                logging.getLogger("sidecar").error("cannot use --chat-template %s: %s", args.chat_template, problem)
                return 2
    reader = FrameReader(in_fd, args.limits.max_frame_bytes, closed)
    reader.start()
    logging.getLogger("sidecar").info("serving on fds %d,%d; forward passes on %d thread(s)", in_fd, out_fd,
                                      torch.get_num_threads())
    return server.serve(reader.inbox)


if __name__ == "__main__":
    try:
        status = main()
    except KeyboardInterrupt:  # SIGINT (Ctrl-C in a terminal): a stop like SIGTERM's, without a traceback
        status = 128 + 2
    # Skip interpreter teardown (torch's takes most of a second): a dying BEAM must see us gone at once.
    sys.stderr.flush()
    os._exit(status)
