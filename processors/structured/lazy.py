"""A regular constraint's token automaton made as generation reaches its states, not ahead.

Compiling ahead walks every token from every state of the byte automaton (`trie.token_transitions`): at
32k tokens, most of a second for a JSON schema whose generations visit a fraction of its states. When
each byte is a token of its own (`build.covers_every_byte`), what a state allows depends on that state
alone: the tokens whose bytes lead through the byte automaton to a state from which it can still end
(`live`), since the rest of any text can then be written byte by byte. So the compile sends the byte
automaton only; a state's tokens are walked (from that one state, through the vocabulary's trie) the
first time a step reaches it, and kept; and a row advances by walking its token's bytes through the
byte automaton, with no token-level table at all. Masks are what `automaton.TokenAutomaton`'s are, state
for state (the tests compare them along walks).

The first step into a state pays its walk (`trie.tokens_from`) on the generating thread: for the
benchmark's schema over 32k tokens, 0.1 ms at the median, 0.5 ms at the 90th percentile, 1-2 ms at most
(a state inside a string allows most of the vocabulary, whose trie it walks nearly whole); 1.6 ms for
each of the 2,005 states of `[ -~]{0,2000}`, which allow ~31.6k tokens each. Each state is walked once per
constraint and vocabulary, and kept with the compiled constraint in the compile cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from . import automaton as token_automaton
from .locks import ForkSafeLock
from .trie import TokenTrie, tokens_from
from .vocabulary import Vocabulary

MAX_VOCABULARIES = 4  # vocabularies whose trie and token bytes are kept here (a sidecar loads a few models)
STAY, DEAD = 256, 257  # byte columns of `LazyAutomaton.moves`: each state stays where it is, or goes dead
HEAD_BYTES = 16  # a token's first bytes, kept side by side for all tokens (`TokenPaths.head`)


@dataclass(frozen=True)
class TokenPaths:
    """Each token's bytes, to walk the tokens of all rows at once: the first `HEAD_BYTES` of token t in
    `head[t]`, padded with `STAY`, and all of them in `flat[starts[t] : starts[t] + lengths[t]]`, for the
    rare longer token. A token that writes nothing (special or unused), and the extra row `vocab` that
    stands for any id outside the vocabulary, is the one byte `DEAD`. At 32k tokens, padding every token
    to the longest (128 bytes) would take 8 MiB against 1 MiB."""

    head: np.ndarray  # uint16 [vocab + 1, HEAD_BYTES]
    flat: np.ndarray  # uint16: every token's bytes, one after another
    starts: np.ndarray  # int64 [vocab + 1]
    lengths: np.ndarray  # int64 [vocab + 1]: bytes to walk

    @classmethod
    def of(cls, vocabulary: Vocabulary) -> "TokenPaths":
        tokens = vocabulary.token_bytes + (None,)
        lengths = np.fromiter((len(t) if t else 1 for t in tokens), dtype=np.int64, count=len(tokens))
        head = np.full((len(tokens), HEAD_BYTES), STAY, dtype=np.uint16)
        for token_id, written in enumerate(tokens):
            if written:
                head[token_id, : min(len(written), HEAD_BYTES)] = list(written[:HEAD_BYTES])
            else:
                head[token_id, 0] = DEAD
        flat = np.frombuffer(b"".join(t for t in tokens if t), dtype=np.uint8).astype(np.uint16)  # STAY fits beside
        written = np.fromiter((len(t) if t else 0 for t in tokens), dtype=np.int64, count=len(tokens))
        return cls(head, flat, np.cumsum(written) - written, lengths)


_walkers: OrderedDict[str, tuple[TokenTrie, TokenPaths]] = OrderedDict()
_walkers_lock = ForkSafeLock()
_making = ForkSafeLock()  # held while a state's tokens or bias row are made, by any automaton


def walkers(vocabulary: Vocabulary) -> tuple[TokenTrie, TokenPaths]:
    """The vocabulary's trie and token bytes, made once per vocabulary (about a tenth of a second at 32k tokens)."""
    with _walkers_lock:
        found = _walkers.get(vocabulary.fingerprint)
        if found is None:
            found = _walkers[vocabulary.fingerprint] = TokenTrie.build(vocabulary.text_tokens()), TokenPaths.of(vocabulary)
            while len(_walkers) > MAX_VOCABULARIES:
                _walkers.popitem(last=False)
        _walkers.move_to_end(vocabulary.fingerprint)
        return found


class LazyAutomaton(token_automaton.Stepping):
    """A compiled regular constraint over a vocabulary in which every byte is a token: the byte automaton
    (`moves`, int64 [S + 1, 258]: the 256 bytes, then `STAY` and `DEAD`; the dead state S last, every
    state it cannot end from leading there) and the states where it may end (`accepting`); states are the
    byte automaton's. Each state's text tokens are found when first asked for (`text_mask`), and distinct
    sets of them kept once (`texts`)."""

    def __init__(self, initial: int, byte_table: np.ndarray, accepting: np.ndarray, vocabulary: Vocabulary):
        """Over the arrays `build.byte_tables` made."""
        self.initial, self.accepting = initial, accepting
        self.vocab_size, self.token_bytes = vocabulary.size, vocabulary.token_bytes
        self.trie, self.paths = walkers(vocabulary)
        states = np.arange(len(byte_table))[:, None]
        self.moves = np.concatenate([byte_table, states, np.full_like(states, len(byte_table) - 1)], axis=1)
        self.mask_of = np.full(len(byte_table), -1, dtype=np.int64)  # each state's index in `texts`, -1 until asked
        self.texts: list[np.ndarray] = []  # the distinct sets of text tokens, sorted int32 ids (half of int64's bytes)
        self._seen: dict[bytes, int] = {}
        self.text_bytes = 0  # of `texts`, counted as they come (the compile cache asks at every use)
        self.bound: dict = {}  # (eos ids, device) -> its masks
        self.one_rows: dict = {}  # state -> tensor([state])
        self.memo: dict = {}  # state * vocab_size + token -> next state
        self.text_mask(initial)  # on the compiling thread: the first step of every generation needs it

    @property
    def dead(self) -> int:
        return len(self.moves) - 1

    @property
    def nbytes(self) -> int:
        """Its tables, the masks made so far and the steps it remembers (what the compile cache holds on to);
        the vocabulary's trie is shared by every constraint over it."""
        return self._own_bytes + sum(m.nbytes for m in list(self.bound.values()))

    @property
    def reserved_bytes(self) -> int:
        """`nbytes` with each set of masks counted at what it may grow to while generations run: what the
        constraint budget reserves, as the KV budget reserves a generation's tokens to its end."""
        return self._own_bytes + sum(m.reserved_bytes for m in list(self.bound.values()))

    @property
    def _own_bytes(self) -> int:
        own = self.moves.nbytes + self.accepting.nbytes + self.mask_of.nbytes + self.text_bytes
        return own + len(self.memo) * token_automaton.MEMO_STEP_BYTES

    def to(self, device) -> "LazyAutomaton":
        """Itself: rows advance in numpy whatever their device (`advance`); masks are bound per device."""
        return self

    def text_mask(self, state: int) -> int:
        """The index in `texts` of the tokens `state` allows, walked the first time it is asked for."""
        index = int(self.mask_of[state])
        if index >= 0:
            return index
        with _making:
            index = int(self.mask_of[state])
            if index < 0:
                tokens = self._walk(state)
                digest = hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()
                index = self._seen.get(digest)
                if index is None:  # each write after what it names: a process forked midway sees no half of it
                    self.texts.append(tokens)
                    self.text_bytes += tokens.nbytes
                    index = self._seen[digest] = len(self.texts) - 1
                self.mask_of[state] = index  # last: another thread reads it without the lock
        return index

    def _walk(self, state: int) -> np.ndarray:
        """The text tokens whose bytes lead from `state` to a state the text can still end from, sorted."""
        if state == self.dead:
            return np.empty(0, dtype=np.int32)
        return tokens_from(self.moves, state, self.trie, self.vocab_size)

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The state after each row's token, walked through the byte automaton for all rows at once, one
        byte a pass; a token that cannot be written from its row's state leads to the dead state."""
        after = torch.from_numpy(self._walk_tokens(states.cpu().numpy(), tokens.cpu().numpy()))  # cpu(): itself there
        return after if states.is_cpu else after.to(states.device)

    def _walk_tokens(self, states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        paths = self.paths
        known = np.minimum(tokens.astype(np.uint64), self.vocab_size)  # an id outside (either side): the extra row
        head = paths.head[known]
        longest = int(paths.lengths[known].max(initial=0))
        current = np.array(states, dtype=np.int64)  # a copy: never the caller's memory
        for depth in range(min(longest, HEAD_BYTES)):
            current = self.moves[current, head[:, depth]]
        if longest > HEAD_BYTES:  # a longer token (a run of spaces), now and then
            lengths, starts = paths.lengths[known], paths.starts[known]
            for depth in range(HEAD_BYTES, longest):
                written = paths.flat[np.minimum(starts + depth, len(paths.flat) - 1)]
                current = self.moves[current, np.where(lengths > depth, written, STAY)]
        return current

    def _step(self, state: int, token: int) -> int:
        """Walked in Python: a handful of bytes, where numpy's calls would cost tens of us."""
        written = self.token_bytes[token]
        if not written:
            return self.dead
        for byte in written:
            state = self.moves.item(state, byte)
        return state

    def _bind(self, eos_token_ids: tuple[int, ...], device: torch.device) -> "LazyMasks":
        return LazyMasks(self, eos_token_ids, device)


class LazyMasks:
    """`automaton.BoundMasks` for a `LazyAutomaton`: each state's bias row (0 for the tokens it allows,
    end-of-sequence ones where it may end, -inf for the others) is made the first time a step asks for it,
    and a row is shared by the states with the same tokens and the same ending. The rows are at most
    one per state: the compile checked their bytes against `build.MAX_MASK_BYTES` (with the ids of
    the rows that allow few tokens, `automaton.most_kept`, up to an eighth more).

    On the CPU the rows are made in numpy, in an array the tensor `bias` shares: torch would run the copy
    of a growing table on its thread pool, which hangs in a process forked after that pool started (a
    `multiprocessing` worker, say), where the masks of a constraint compiled ahead, made at bind, work."""

    def __init__(self, automaton: LazyAutomaton, eos_token_ids: tuple[int, ...], device: torch.device):
        self.automaton, self.device = automaton, device
        self.eos = np.asarray(eos_token_ids, dtype=np.int64)
        self.mask_of = np.full(len(automaton.moves), -1, dtype=np.int64)  # each state's row of `bias`, -1 until asked
        self.count = 0
        self._table = np.empty((0, automaton.vocab_size), dtype=np.float32)  # on the CPU, what `bias` shares
        self.bias = self._tensor(self._table)
        self._rows: dict[tuple[int, bool], int] = {}  # (text mask, whether it may end) -> its row
        self.kept: dict[int, np.ndarray] = {}  # row -> the int32 ids it allows, for rows allowing few (`masked`)
        self.kept_bytes = 0  # of `kept`, counted as they come
        self.views: dict = {}  # row -> a view of it (see `row`)

    def _tensor(self, table: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(table) if self.device.type == "cpu" else torch.from_numpy(table).to(self.device)

    @property
    def nbytes(self) -> int:
        return self.bias.numel() * self.bias.element_size() + self.kept_bytes + self.mask_of.nbytes

    @property
    def reserved_bytes(self) -> int:
        """What it may grow to: a row for every state (`_append` grows the table no further), and the ids
        it may keep."""
        vocab_size = self.automaton.vocab_size
        return len(self.mask_of) * (vocab_size + token_automaton.most_kept(vocab_size)) * 4 + self.mask_of.nbytes

    def row(self, state: int) -> torch.Tensor:
        """float32 [vocab]: one state's bias row on the CPU, a view kept per row (see `BoundMasks.row`)."""
        index = int(self.mask_of[state])
        if index < 0:
            index = self._make(state)
        view = self.views.get(index)
        if view is None:
            view = self.views[index] = self.bias[index]
        return view

    def rows(self, states: torch.Tensor) -> torch.Tensor:
        """float32 [rows, vocab]: each state's bias row."""
        index = self.indices(states.cpu().numpy())
        bias = self.bias  # read after the rows' indices: it is replaced before they are published
        index = torch.from_numpy(index)
        return bias.index_select(0, index if bias.is_cpu else index.to(bias.device))

    def masked(self, states: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (float32, on the CPU) with each row's state's mask applied, in a new tensor."""
        index = self.indices(states)
        return token_automaton.masked(self._table, self.kept, index, logits)

    def allowed(self, states: torch.Tensor) -> torch.Tensor:
        """bool [rows, vocab]: what each state allows."""
        return self.rows(states) == 0

    def indices(self, states: np.ndarray) -> np.ndarray:
        """Each state's row, made if it was not. The table is replaced before a row in it is published:
        read it after these."""
        index = self.mask_of[states]
        if (index < 0).any():
            for state in np.unique(states[index < 0]).tolist():
                self._make(state)
            index = self.mask_of[states]
        return index

    def _make(self, state: int) -> int:
        """Makes `state`'s row (or finds the one it shares) and returns its index."""
        text = self.automaton.text_mask(state)
        with _making:
            index = int(self.mask_of[state])
            if index >= 0:
                return index
            tokens = np.setdiff1d(self.automaton.texts[text], self.eos, assume_unique=True)
            ending = bool(self.automaton.accepting[state]) or not len(tokens)  # nowhere to go: it ends
            index = self._rows.get((text, ending))
            if index is None:
                row = np.full(self.automaton.vocab_size, token_automaton.NEG_INF, dtype=np.float32)
                row[tokens] = 0.0
                if ending:
                    row[self.eos] = 0.0
                index = self._append(row)
                kept = token_automaton.kept_ids(row == 0)
                if kept is not None:
                    self.kept[index] = kept
                    self.kept_bytes += kept.nbytes
                self._rows[(text, ending)] = index
            self.mask_of[state] = index  # last: readers go without the lock
            return index

    def _append(self, row: np.ndarray) -> int:
        """Adds a row: in the table's room, or in one twice as large, up to one row per state (past that
        only if a process was forked while a row was being added, which leaves that row unnamed)."""
        if self.count == len(self._table):
            grown = np.empty((max(min(2 * self.count, len(self.mask_of)), self.count + 1, 8), self.automaton.vocab_size),
                             dtype=np.float32)
            grown[: self.count] = self._table[: self.count]
            grown[self.count] = row
            self._table, self.bias, self.views = grown, self._tensor(grown), {}
        elif self.device.type == "cpu":
            self._table[self.count] = row
        else:
            self._table[self.count] = row
            self.bias[self.count] = torch.from_numpy(row).to(self.device)
        self.count += 1
        return self.count - 1
