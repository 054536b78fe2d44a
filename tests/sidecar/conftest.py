import contextlib
import gc
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from protocol.peer import Peer
from sidecar import Engine
from sidecar.default_model import materialise
from sidecar.kv import DecodeGroup


@pytest.fixture(scope="session")
def default_dir(isolated_model_cache):
    return materialise()


@pytest.fixture(scope="session")
def engine(default_dir):
    return Engine.load()


@pytest.fixture(scope="session")
def per_token(engine):
    """Bytes one token of the default model's cache takes (a budget in tokens is this times the tokens)."""
    return engine.store.bytes_per_token


@pytest.fixture(scope="session")
def gpt2_dir(default_dir, tmp_path_factory):
    """A GPT-2-style model (absolute positions) with the shipped tokenizer, saved as a local directory."""
    path = tmp_path_factory.mktemp("gpt2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, path / name)
    torch.manual_seed(1)
    config = GPT2Config(vocab_size=1024, n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gpt2_engine(gpt2_dir):
    return Engine.load(gpt2_dir)


@pytest.fixture(params=["llama", "gpt2"])
def any_engine(request, engine, gpt2_engine):
    return {"llama": engine, "gpt2": gpt2_engine}[request.param]


@pytest.fixture
def group_sizes(monkeypatch):
    """The number of members of every group formed (a test of the group must see one formed)."""
    sizes = []
    update = DecodeGroup.update

    def spied(self, caches, chain=()):
        members = self.members
        grouped = update(self, caches, chain)
        if grouped and self.members is not members:  # formed now, not kept from the step before
            sizes.append(len(self.members))
        return grouped

    monkeypatch.setattr(DecodeGroup, "update", spied)
    return sizes


def tokens(n: int, seed: int, low: int = 3, high: int = 1000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g).tolist()


_UNSHARED = {}


def unshared(engine: Engine) -> Engine:
    """An engine on `engine`'s model that shares no prefixes across sessions: its fresh sessions compute
    everything, so they are a cold reference even while the sessions under test hold the same prefix."""
    if id(engine) not in _UNSHARED:
        _UNSHARED[id(engine)] = (engine, Engine(engine.model, engine.tokenizer, share_prefixes=False))
    return _UNSHARED[id(engine)][1]


def assert_books_balance(store) -> None:
    """The KV store's books: its bytes are its caches' (within the budget), each reference count is the
    number of caches continuing that cache, and everything a cache reads is still held by the store."""
    caches = list(store._caches.values())
    assert store.used_bytes == sum(c.nbytes for c in caches) <= store.budget_bytes
    assert store._entries == sum(c.tokens is not None for c in caches)
    for cache in caches:
        assert cache.refs == sum(c.prefix is cache for c in caches)
        link = cache.prefix
        while link is not None:
            assert any(link is c for c in caches) and link.length > 0
            link = link.prefix


def unused_entries(engine) -> list:
    """The shared entries no open session's cache continues, directly or through other entries (between
    calls nothing else holds one): those PROTOCOL.md caps at 256 ("At most 256 shared prefixes that no
    session continues are kept"), found from the sessions, not from the store's reference counts."""
    continued = set()
    for session in engine.sessions:
        link = session.cache.prefix
        while link is not None:
            continued.add(id(link))
            link = link.prefix
    return [entry for entry in engine.store.shared if id(entry) not in continued]


def reference_common_prefix(a, b, start=0, end=None) -> int:
    """`sharing.common_prefix` token by token, as it was written first."""
    n = min(len(a) if end is None else end, len(b))
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n


def reference_find(session, input_ids, own):
    """`sharing.find` as it was first written: every entry and idle session compared in full, token by token.
    Returns what it picks as (tokens, entry, session), or None."""
    from sidecar.sharing import MAX_DEPTH, MIN_SHARED_TOKENS

    engine = session.engine
    if not engine.share_prefixes:
        return None
    best = (own + MIN_SHARED_TOKENS - 1, None, None)
    held = {}
    for entry in engine.store.shared:
        held[id(entry)] = n = reference_common_prefix(entry.tokens, input_ids, end=entry.exact)
        if n > best[0] and entry.depth < MAX_DEPTH:
            best = (n, entry, None)
    for other in engine.sessions:
        cache = other.cache
        if other is session or cache.length == 0 or cache.pinned or cache.refs or cache.depth >= MAX_DEPTH:
            continue
        start = cache.offset
        if start and held.get(id(cache.prefix), 0) < start:
            continue
        n = reference_common_prefix(other.history, input_ids, start, cache.exact)
        if n > best[0]:
            best = (n, None, other)
    return best if best[1] is not None or best[2] is not None else None


def picked(source):
    """What `sharing.find` returned, as `reference_find` gives it."""
    return None if source is None else (source.tokens, source.entry, source.session)


shared_server = pytest.mark.shared_server  # the test takes `peer` from a server it may share (see `peer`)


class _Tidy(Peer):
    """A client that remembers the sessions it asked to open or fork, to close them after the test."""

    def send(self, message) -> None:
        if isinstance(message, dict):
            name = {"open_session": message.get("session"), "fork_session": message.get("new")}.get(message.get("op"))
            if isinstance(name, str):
                self.named.add(name)
        super().send(message)


def _left_as_found(peer: _Tidy) -> bool:
    """Closes the sessions the test named and says whether the server is now as a fresh one: no session,
    nothing in flight or cached, one model, no message unread."""
    for name in sorted(peer.named):
        peer.call("close_session", session=name)
    stats = peer.call("stats")["result"]
    model = stats["models"].get("default", {})
    return (not any(peer._messages.values()) and stats["sessions"] == stats["in_flight"] == stats["active_generations"] == 0
            and list(stats["models"]) == ["default"] and model["cache_bytes"] == model["shared_prefixes"] == 0)


@pytest.fixture(scope="module")
def _module_server(default_dir):
    held = []
    yield held
    for peer in held:
        peer.__exit__(None, None, None)  # closed, or killed if it does not end


@pytest.fixture
def peer(_module_server, request):
    """A client of the module's `SERVER` command. A test marked `shared_server` shares one server with the
    other marked tests of its module, which saves a start (4-5 s, the imports of torch and transformers)
    and changes nothing it can see: the sessions it opened are closed after it, and a server left
    otherwise (a session opened under a name `send` did not see, a request in flight, a cache still
    held, another model, a reply unread) is closed and the next test starts its own. Any other test gets
    a server of its own."""
    if request.node.get_closest_marker("shared_server") is None:
        with Peer(request.module.SERVER, stderr=subprocess.DEVNULL) as fresh:
            yield fresh
        return
    if not _module_server:
        _module_server.append(_Tidy(request.module.SERVER, stderr=subprocess.DEVNULL))
    shared = _module_server[0]
    shared.named, shared.replied, shared._next_id = set(), [], 1  # ids as a fresh client's: none is in flight
    clean = False
    try:
        yield shared
        clean = _left_as_found(shared)
    finally:
        if not clean:
            _module_server.pop().__exit__(None, None, None)


@contextlib.contextmanager
def server_on_a_thread():
    """A server, in this process, serving on a thread of its own ("serving") with the default model loaded:
    yields `send(request)`, the queue of the messages it writes, and the server."""
    import queue
    import threading

    from protocol import pack
    from sidecar.server import Server
    from sidecar.transport import Inbox

    class Writer:
        def __init__(self):
            self.replies = queue.Queue()

        def send(self, message, urgent=True):
            self.replies.put(message)

        def flush(self):
            pass

    writer, inbox, switch_interval = Writer(), Inbox(), sys.getswitchinterval()
    server = Server(writer)
    server.load_model({"name": "default", "path": None, "dtype": None, "device": None, "trust_remote_code": False})
    serving = threading.Thread(target=server.serve, args=(inbox,), name="serving")
    serving.start()

    def send(request):
        payload = pack(request)
        inbox.put(payload, len(payload), lambda: False)

    try:
        yield send, writer.replies, server
    finally:
        inbox.close()
        serving.join(timeout=60)
        gc.unfreeze()  # the server froze this process's heap (`Server.serve`): the tests after collect it again
        sys.setswitchinterval(switch_interval)  # and set the interpreter's switch interval
