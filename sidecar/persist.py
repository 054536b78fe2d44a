"""A session saved to one file and restored from it, also in another process.

The file is safetensors: each layer's keys and values of the cached tokens as tensors, and in its header
the metadata as JSON (the format, the token history, what the model is, the dtype, and a checksum of it
all). safetensors checks that the header and the tensors fit the file, so a truncated file is refused;
the checksum catches bytes changed inside the tensors or the history, which nothing else would. A file
written for another model (weights, config or tokenizer) or dtype is refused: its keys and values would
be silently wrong for this one.

A restore reads the file through one descriptor, opened without following a link or waiting (a FIFO
swapped in for the file would block the process for good), and with read(), never a memory map (a
file cut short while mapped kills the process with SIGBUS). The checksum guards against damage, not
forgery: whoever can write the file can write a valid one, whose keys its session, and the sessions
sharing a prefix with it, then read. Saved sessions are trusted as model directories are: a server's
clients name them, and only the server writes them (`save_session`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from . import sharing
from .errors import CacheBudgetExceeded, InvalidArgument, InvalidSessionFile, SaveFailed, SessionBusy, SessionClosed
from .text import check_unicode

FORMAT = "beam-sidecar-session/3"  # 2: "exact", the tokens whose keys a shift has not moved; 3: the fingerprint
# A file's header: its metadata holds the history, a few bytes a token; a model's context of a million tokens
# fits many times (a larger one is refused before it is parsed).
MAX_HEADER_BYTES = 32 << 20


def model_fingerprint(model, vocabulary_fingerprint: str) -> str:
    """What identifies a model for its caches: its config (but the path it was loaded from: a copy or a
    link to the same directory is the same model), its vocabulary, and a sample of every weight (names,
    shapes and 64 values spread over it: a different checkpoint differs there, and reading it all would
    take as long as loading it). A copy edited only off the sample (crafted, or sparsely edited) passes for
    the same model; PROTOCOL.md says so."""
    config = {key: value for key, value in model.config.to_dict().items() if key != "_name_or_path"}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(vocabulary_fingerprint.encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        flat = tensor.detach().reshape(-1)
        digest.update(flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def save(session, path) -> None:
    """Writes the session's history and cache to `path`, atomically (a reader never sees half a file)."""
    _check_idle(session)
    cache, engine = session.cache, session.engine
    tensors = {}
    for layer, shape in enumerate(engine.store.layers):
        spans = cache.span(layer) if cache.end else None
        for kind, index in (("keys", 0), ("values", 1)):
            tensors[f"{kind}.{layer}"] = (spans[index].contiguous().cpu() if spans is not None else
                                          torch.empty(shape.kv_heads, 0, shape.dim(kind), dtype=engine.store.dtype))
    metadata = {"format": FORMAT, "model": engine.fingerprint, "dtype": str(engine.store.dtype),
                "history": session.history, "cached": cache.end, "exact": cache.exact}
    metadata["digest"] = _digest(metadata, tensors)
    path = _file_path(path)
    partial = None
    try:
        # a link is neither followed (out of a server's session directory) nor replaced, nor is a
        # device, a FIFO or a directory: only a regular file, or nothing, is written over
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise SaveFailed(f"cannot write the session to {path.name}: it exists and is not a regular file")
        # a name of its own, created empty (whatever else lies beside the target is left alone)
        descriptor, partial = tempfile.mkstemp(prefix=f".{path.name[:100]}.", suffix=".partial", dir=path.parent)
        os.close(descriptor)
        save_file(tensors, partial, metadata={"session": json.dumps(metadata)})
        os.replace(partial, path)
    except (OSError, SafetensorError) as error:  # a name too long, a full disk (safetensors' own error)
        if partial is not None:
            Path(partial).unlink(missing_ok=True)
        raise SaveFailed(f"cannot write the session to {path.name[:60]}: {getattr(error, 'strerror', None) or error}") from None


def _file_path(path) -> Path:
    """`path` as a `Path`, refused with `InvalidArgument` unless it is a non-empty text path without NUL
    (which the OS would refuse with errors of other kinds, deep inside the write)."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text or "\0" in text or text.endswith(("/", os.sep)):
        raise InvalidArgument(f"path must be a non-empty file path (a str or a pathlib.Path, without NUL, not "
                              f"ending in a separator), got {str(path)[:60]!r}", option="path")
    check_unicode(text, "path")
    return Path(text)


def restore(engine, path):
    """A new session of `engine` holding what `path` saved. Raises `InvalidSessionFile` naming the problem,
    `CacheBudgetExceeded` when its cache does not fit; either way nothing changes.

    The header is checked first (format, model, dtype, history, the tensors' names, shapes and dtypes)
    and the budget next, so a file that lies about its size is refused before its tensors are read.
    """
    path = _file_path(path)
    name = path.name[:60]
    with _open_saved(path) as file:
        try:
            header, size = _read_header(file, name)
            metadata = json.loads(header.get("__metadata__", {}).get("session", "null"))
            history, cached = _check_header(engine, metadata, name)
            _check_layout(engine, header, cached, name)
            extra = cached * engine.store.bytes_per_token
            if not engine.store.could_fit(extra):
                raise _over_budget(engine, "restoring", cached, extra)
            file.seek(0)
            content = file.read(size + 1)  # one byte more than the header says the file holds tells of a longer one
            if len(content) != size:
                raise InvalidSessionFile(f"the saved session {name} is {'truncated' if len(content) < size else 'too long'}")
            tensors = load(content)
            del content
        except (OSError, SafetensorError, ValueError, RecursionError) as error:
            raise InvalidSessionFile(f"cannot read the saved session {name}: {str(error)[:200]}") from None
    if metadata.get("digest") != _digest(metadata, tensors):
        raise InvalidSessionFile(f"{name} is corrupted: its contents do not match their checksum")
    if not engine.store.make_room(extra):  # only now, for a file known good, are idle caches evicted
        raise _over_budget(engine, "restoring", cached, extra)
    session = engine.session()
    try:
        session.history = history
        if cached:
            cache = session.cache
            cache.reserve(cached)
            for layer in range(len(engine.store.layers)):
                cache.keys[layer][0, :, :cached] = tensors[f"keys.{layer}"]
                cache.values[layer][0, :, :cached] = tensors[f"values.{layer}"]
            cache.length = cached
            if metadata["exact"] < cached:  # keys a rolling shift moved stay unshared after a restore too
                cache.approximate_from = metadata["exact"]
    except BaseException:  # an allocation failing: no half-restored session stays behind
        session.close()
        raise
    return session


def _open_saved(path: Path):
    """The saved file, open for reading: a regular file, not a link (a server's session directory is
    not left through one, as `save` does not write through one), never waited for."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidSessionFile(f"no saved session {path.name[:60]}") from None
    except OSError as error:  # ELOOP: a link (O_NOFOLLOW); a name too long, a directory we may not read...
        problem = "it is a symbolic link" if error.errno == errno.ELOOP else (error.strerror or str(error))
        raise InvalidSessionFile(f"cannot read the saved session {path.name[:60]}: {problem}") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # a directory, a FIFO or a device would block or mislead
        os.close(descriptor)
        raise InvalidSessionFile(f"the saved session {path.name[:60]} is not a regular file")
    return os.fdopen(descriptor, "rb")


def _read_header(file, name: str) -> tuple[dict, int]:
    """A safetensors file's header, and the size the whole file has by it (its tensors end the file). The
    header's shape is checked here, where it is read: a map of string metadata, and of tensors, each
    with its two data offsets."""
    prefix = file.read(8)
    if len(prefix) < 8:
        raise InvalidSessionFile(f"the saved session {name} is truncated")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise InvalidSessionFile(f"the saved session {name} has a header of {length} bytes, more than the "
                                 f"{MAX_HEADER_BYTES} a saved session's can take")
    text = file.read(length)
    if len(text) < length:
        raise InvalidSessionFile(f"the saved session {name} is truncated")
    header = json.loads(text)
    tensors = [entry for key, entry in header.items() if key != "__metadata__"] if isinstance(header, dict) else None
    if not (tensors is not None and _is_metadata(header.get("__metadata__", {}))
            and all(isinstance(entry, dict) and _is_offsets(entry.get("data_offsets")) for entry in tensors)):
        raise InvalidSessionFile(f"{name} is not a safetensors file")
    return header, 8 + length + max((entry["data_offsets"][1] for entry in tensors), default=0)


def _is_metadata(value) -> bool:
    return isinstance(value, dict) and all(isinstance(text, str) for text in value.values())


def _is_offsets(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(type(end) is int and end >= 0 for end in value)


def _over_budget(engine, doing: str, cached: int, extra: int, keep: tuple = ()) -> CacheBudgetExceeded:
    """The refusal of `extra` bytes, saying what the budget leaves with every idle cache (but `keep`) evicted,
    and whether the running generations' reservations are what it lacks: a restore or a fork does not
    wait for them as a generation does (PROTOCOL, "Memory"), so the client is told it may try again."""
    store = engine.store
    held = store.unevictable_bytes(keep)
    alone = store.alone_bytes(keep)
    if alone + extra <= store.budget_bytes:
        after = f"; the running generations hold {held - alone} of them: it fits once they end"
    else:
        after = "; it does not fit even with no generation running"
    return CacheBudgetExceeded(
        f"{doing} {cached} cached tokens needs {extra} bytes, more than the cache budget leaves: "
        f"{max(0, store.budget_bytes - held)} of its {store.budget_bytes} bytes (cache_budget_bytes) once idle "
        f"caches are evicted{after}", limit="cache_budget_bytes", max=store.budget_bytes, value=held + extra)


def fork(session):
    """A new, independent session with the same history and last result, continuing the same cache: nothing
    is recomputed, nothing copied (the cache becomes a shared entry both continue; a copy when its chain
    is too deep)."""
    _check_idle(session)
    engine, cache = session.engine, session.cache
    if cache.length and (cache.depth >= sharing.MAX_DEPTH or not engine.share_prefixes):
        extra = cache.end * engine.store.bytes_per_token
        if not engine.store.make_room(extra, keep=(cache,)):
            raise _over_budget(engine, "forking", cache.end, extra, keep=(cache,))
    twin = engine.session()
    twin.history = list(session.history)
    twin.last = session.last
    if not sharing.fork(session, twin):
        twin.cache.reserve(cache.end)
        twin.cache.copy_prefix(cache)
    return twin


def _check_idle(session) -> None:
    if session.closed:
        raise SessionClosed(f"session {session.id} is closed")
    if session.busy:
        raise SessionBusy(f"session {session.id} is generating; its cache is changing")


def _digest(metadata: dict, tensors: dict[str, torch.Tensor]) -> str:
    """A checksum of the metadata (but the digest) and of every tensor's bytes: a changed token in the
    history would make the cache silently wrong for it, as a changed byte in the cache would. CRC-32
    finds corruption at memory speed (a sha256 of the cache was most of a save and a restore); it does
    not stop someone who can write the session directory, who could as well write a valid file."""
    text = json.dumps({k: v for k, v in metadata.items() if k != "digest"}, sort_keys=True).encode()
    checksum = zlib.crc32(text)
    for name in sorted(tensors):
        checksum = zlib.crc32(name.encode(), checksum)
        if tensors[name].numel():
            checksum = zlib.crc32(tensors[name].view(torch.uint8).numpy().data, checksum)
    return f"crc32:{checksum:08x}"


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _check_header(engine, metadata, name: str) -> tuple[list[int], int]:
    """The history and cached length of a file's metadata, once the metadata has been checked."""
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise InvalidSessionFile(f"{name} is not a saved session of this format ({FORMAT})")
    if metadata.get("dtype") != str(engine.store.dtype):  # before the model, whose fingerprint covers the dtype too
        raise InvalidSessionFile(f"{name} holds a cache in {str(metadata.get('dtype'))[:32]}, this model runs in "
                                 f"{engine.store.dtype}")
    if metadata.get("model") != engine.fingerprint:
        raise InvalidSessionFile(f"{name} was saved from another model (fingerprint {str(metadata.get('model'))[:32]}, "
                                 f"this model's is {engine.fingerprint})")
    history, cached = metadata.get("history"), metadata.get("cached")
    if not (isinstance(history, list) and all(type(t) is int and 0 <= t < engine.vocab_size for t in history)
            and type(cached) is int and 0 <= cached <= len(history)
            and type(metadata.get("exact")) is int and 0 <= metadata["exact"] <= cached):
        raise InvalidSessionFile(f"{name} has a malformed history")
    if engine.max_context is not None and len(history) > engine.max_context:
        raise InvalidSessionFile(f"{name} holds {len(history)} tokens, more than the model's context of "
                                 f"{engine.max_context}")
    return history, cached


def _check_layout(engine, header: dict, cached: int, name: str) -> None:
    """The file holds exactly this model's keys and values for `cached` tokens (read from its header only)."""
    expected = {f"{kind}.{layer}": [shape.kv_heads, cached, shape.dim(kind)]
                for layer, shape in enumerate(engine.store.layers) for kind in ("keys", "values")}
    dtype = SAFETENSORS_DTYPES.get(engine.store.dtype)
    if set(header) - {"__metadata__"} != set(expected) or any(
            header[key].get("shape") != shape or header[key].get("dtype") != dtype for key, shape in expected.items()):
        raise InvalidSessionFile(f"{name} does not hold this model's cache layout for {cached} tokens")
