"""A token-level automaton as tensors: the per-step work of every constraint is two lookups and a mask.

States are numbered 0..S-1 and `S` is the dead state (a token no transition allows leads there). A state's
transitions are found by `searchsorted` on sorted keys `state * vocab + token`, so advancing every row is
one vectorised lookup; a state's forbidden tokens are one row of a table holding each distinct mask once
(many states share one: every state inside a JSON string allows the same tokens), kept as booleans and
bound, once per set of end tokens and device, into float bias rows that a step adds to the logits (or,
for a mask allowing few tokens of a large vocabulary, their ids, whose logits a step copies). All of it
is built once per (constraint, vocabulary) and shared by every generation using them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .build import tables

MAX_MEMO_STEPS = 65_536  # one-row steps remembered per automaton
MEMO_STEP_BYTES = 100  # what one remembered step holds: a dict slot and two ints
FEW_TOKENS = 8  # a mask allowing at most vocab // FEW_TOKENS tokens also keeps their ids (see `masked`)
KEEP_IDS_FROM_VOCAB = 16_384  # ids are kept over this many tokens at least: below, adding whole bias rows costs less
NEG_INF = float("-inf")


class Stepping:
    """What every compiled automaton does the same way: a row's step on the CPU (`step`), remembered; the
    one-row path's state tensors; its masks, bound once per set of end tokens and device. Each kind says
    how a step is found (`_step`) and how masks are bound (`_bind`), and has `vocab_size`, `dead`, `memo`,
    `one_rows` and `bound`."""

    def step(self, state: int, token: int) -> int:
        """`advance` for one row on the CPU, in plain Python or numpy: a handful of torch calls cost more
        than the lookup itself. Steps taken are remembered (up to `MAX_MEMO_STEPS`, then forgotten at
        once): a dict lookup costs a tenth of numpy's `searchsorted` call, and generations keep taking the
        same steps. An id outside the vocabulary leads to the dead state, remembered nowhere: its key
        would be another state's step."""
        if not 0 <= token < self.vocab_size:
            return self.dead
        wanted = state * self.vocab_size + token
        found = self.memo.get(wanted)
        if found is None:
            found = self._step(state, token)
            if len(self.memo) >= MAX_MEMO_STEPS:
                self.memo.clear()
            self.memo[wanted] = found
        return found

    def one_row(self, state: int) -> torch.Tensor:
        """`tensor([state])`, the one-row path's state, made once per state and shared (a state tensor is
        never written in place: `Chain.reorder` selects into a new one); making it costs microseconds."""
        tensor = self.one_rows.get(state)
        if tensor is None:
            tensor = self.one_rows[state] = torch.tensor([state])
        return tensor

    def masks(self, eos_token_ids: tuple[int, ...], device):
        """Its masks with `eos_token_ids` on `device`, bound once per set of them and device, and shared."""
        key = (eos_token_ids, torch.device(device))
        if key not in self.bound:
            self.bound[key] = self._bind(eos_token_ids, torch.device(device))
        return self.bound[key]


@dataclass(frozen=True)
class TokenAutomaton(Stepping):
    """The tables of a compiled constraint. `accepting[s]`: the text may end in state s (a state with
    nowhere to go may end too: `with_end_tokens`)."""

    initial: int
    vocab_size: int
    keys: torch.Tensor  # int64 [T + 1], sorted: state * vocab_size + token, then a sentinel larger than all
    targets: torch.Tensor  # int64 [T + 1]: the state each key leads to (the dead state for the sentinel)
    mask_of: torch.Tensor  # int64 [S + 1]: the row of `forbidden` for each state, the dead state last
    forbidden: torch.Tensor  # bool [M, vocab_size]: the distinct masks, text tokens only
    accepting: torch.Tensor  # bool [S + 1]
    copies: dict = field(default_factory=dict, compare=False, repr=False)  # device -> this automaton there
    bound: dict = field(default_factory=dict, compare=False, repr=False)  # (eos ids, device) -> its masks
    one_rows: dict = field(default_factory=dict, compare=False, repr=False)  # state -> tensor([state])
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # state * vocab_size + token -> next state

    def to(self, device) -> "TokenAutomaton":
        """This automaton's transitions on `device` (what `advance` reads; masks are bound per device by
        `masks`), copied once per device and shared like the original."""
        device = torch.device(device)
        if self.keys.device == device:
            return self
        if device not in self.copies:
            self.copies[device] = replace(self, keys=self.keys.to(device), targets=self.targets.to(device),
                                          copies={}, bound={}, one_rows={}, memo={})
        return self.copies[device]

    @property
    def dead(self) -> int:
        return self.mask_of.shape[0] - 1

    @property
    def reserved_bytes(self) -> int:
        """Its bytes as the constraint budget counts them: its masks are made whole when bound."""
        return self.nbytes

    @property
    def nbytes(self) -> int:
        """Its tables, the masks bound from them and the steps it remembers (what the compile cache holds on to)."""
        tensors = [self.keys, self.targets, self.mask_of, self.forbidden, self.accepting]
        tensors += [t for masks in self.bound.values() for t in (masks.mask_of, masks.bias)]
        kept = sum(masks.kept_bytes for masks in self.bound.values())
        return sum(t.numel() * t.element_size() for t in tensors) + kept + len(self.memo) * MEMO_STEP_BYTES

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The state after each row's token: one `searchsorted` for all rows; a token with no transition
        leads to the dead state. On the CPU in numpy, on the tensors' own memory: each torch call costs
        several microseconds more than numpy's (8 x 32k rows along the benchmark's walks, 28.7 against
        27.5 us a row for the whole step)."""
        if states.is_cpu and tokens.is_cpu:
            keys, targets = self._tables
            here = tokens.numpy()
            # an id outside the vocabulary (either side) would read another state's key: it looks up -1, no key
            wanted = np.where(here.astype(np.uint64) < self.vocab_size, states.numpy() * self.vocab_size + here, -1)
            where = np.searchsorted(keys, wanted)
            return torch.from_numpy(np.where(keys[where] == wanted, targets[where], self.dead))
        return self.advance_in_torch(states, tokens)

    def advance_in_torch(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`advance` on any device."""
        wanted = tokens.add(states, alpha=self.vocab_size).masked_fill_((tokens < 0) | (tokens >= self.vocab_size), -1)
        where = torch.searchsorted(self.keys, wanted)  # the keys end with a sentinel larger than any key
        found = self.keys.index_select(0, where) == wanted
        return torch.where(found, self.targets.index_select(0, where), self.targets[-1])

    def _step(self, state: int, token: int) -> int:
        keys, targets = self._tables
        wanted = state * self.vocab_size + token
        where = int(np.searchsorted(keys, wanted))
        return int(targets[where]) if keys[where] == wanted else self.dead

    @functools.cached_property
    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        """`keys` and `targets` as numpy views (taking a view costs a step's worth of time each call)."""
        return self.keys.numpy(), self.targets.numpy()

    def _bind(self, eos_token_ids: tuple[int, ...], device: torch.device) -> "BoundMasks":
        return self.with_end_tokens(torch.tensor(eos_token_ids, dtype=torch.long)).to(device)

    def with_end_tokens(self, eos_token_ids: torch.Tensor) -> "BoundMasks":
        """The masks with the end-of-sequence tokens allowed exactly where a state may end: in accepting
        states, and in any state left with no token once they are taken out (one with no transition, the
        dead state, or a user's automaton's whose only transitions are on end-of-sequence tokens: it can
        go nowhere else, so it ends, never an all -inf row)."""
        # a mask row shared by accepting and other states is split in two: (mask, accepting) as one key, whose
        # sort is the pairs' (at 20,000 states: 1.1 ms, where unique over rows of pairs took 38 ms)
        distinct, inverse = torch.unique(self.mask_of * 2 + self.accepting.long(), return_inverse=True)
        forbidden = self.forbidden.index_select(0, distinct // 2)
        forbidden[:, eos_token_ids] = True
        ending = (distinct % 2).bool() | forbidden.all(dim=1)
        forbidden[ending.nonzero().squeeze(1).unsqueeze(1), eos_token_ids.unsqueeze(0)] = False
        bias = torch.zeros(forbidden.shape, dtype=torch.float32).masked_fill_(forbidden, NEG_INF)
        allowed = ~forbidden
        few = (allowed.sum(dim=1) <= most_kept(allowed.shape[1])).nonzero().squeeze(1).tolist()  # checked alone
        kept = {index: ids for index in few if (ids := kept_ids(allowed[index].numpy())) is not None}
        return BoundMasks(inverse, bias, kept)

    @classmethod
    def from_transitions(cls, initial: int, sources, tokens, targets, accepting, vocab_size: int) -> "TokenAutomaton":
        """Builds the tables from transition triples whose states may be any integers (see `tables`)."""
        return cls.from_tables(**tables(initial, sources, tokens, targets, accepting, vocab_size))

    @classmethod
    def from_tables(cls, initial: int, vocab_size: int, keys, targets, mask_of, forbidden, accepting) -> "TokenAutomaton":
        """The automaton over the numpy arrays `tables` made (shared, not copied)."""
        return cls(initial=initial, vocab_size=vocab_size, keys=torch.from_numpy(keys), targets=torch.from_numpy(targets),
                   mask_of=torch.from_numpy(mask_of), forbidden=torch.from_numpy(forbidden),
                   accepting=torch.from_numpy(accepting))


@dataclass(frozen=True)
class BoundMasks:
    """`bias[mask_of[state]]` is 0 for the tokens a state allows, end-of-sequence tokens included, and -inf
    for the others. Adding a gathered bias row is an order of magnitude faster on CPU than `masked_fill`
    with a boolean mask of the same row (measured: 11 against 38 us for one row of 32k), hence float32."""

    mask_of: torch.Tensor
    bias: torch.Tensor
    kept: dict  # mask index -> the int32 ids it allows, for the masks allowing few (see `masked`); CPU only
    views: dict = field(default_factory=dict, compare=False, repr=False)  # mask index -> its row, a view

    def to(self, device) -> "BoundMasks":
        kept = self.kept if torch.device(device).type == "cpu" else {}
        return BoundMasks(self.mask_of.to(device), self.bias.to(device), kept)

    @functools.cached_property
    def kept_bytes(self) -> int:
        return sum(ids.nbytes for ids in self.kept.values())

    def row(self, state: int) -> torch.Tensor:
        """float32 [vocab]: one state's bias row on the CPU, a view (no copy) made once per mask: indexing a
        tensor with Python ints costs microseconds, which the one-row path spends per token."""
        index = int(self._mask_of[state])
        view = self.views.get(index)
        if view is None:
            view = self.views[index] = self.bias[index]
        return view

    @functools.cached_property
    def _mask_of(self) -> np.ndarray:
        return self.mask_of.numpy()

    @functools.cached_property
    def _bias(self) -> np.ndarray:
        return self.bias.numpy()

    def rows(self, states: torch.Tensor) -> torch.Tensor:
        """float32 [rows, vocab]: each state's bias row."""
        return self.bias.index_select(0, self.mask_of.index_select(0, states))

    def masked(self, states: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (float32, on the CPU) with each row's state's mask applied, in a new tensor."""
        return masked(self._bias, self.kept, self._mask_of[states], logits)

    def allowed(self, states: torch.Tensor) -> torch.Tensor:
        """bool [rows, vocab]: what each state allows."""
        return self.rows(states) == 0


def most_kept(vocab_size: int) -> int:
    """The most token ids a mask keeps (`masked`): none in a small vocabulary, where a bias row is cheap to
    add (measured at 8 rows: the same cost at 8k tokens, 0.7x at 16k, 0.4x at 32k)."""
    return vocab_size // FEW_TOKENS if vocab_size >= KEEP_IDS_FROM_VOCAB else 0


def kept_ids(allowed: np.ndarray) -> np.ndarray | None:
    """The ids a mask keeps, of the tokens `allowed` (bool [vocab]) allows (int32, sorted), if at most
    `most_kept`; else None."""
    if not most_kept(len(allowed)):
        return None
    ids = np.flatnonzero(allowed)
    return ids.astype(np.int32) if len(ids) <= most_kept(len(allowed)) else None


def masked(bias: np.ndarray, kept: dict, indices: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
    """`logits` (float32, on the CPU) with the masks at `indices` applied, one a row, in a new tensor. A
    mask that allows few tokens (`kept`: most states of a JSON schema allow a handful) writes -inf and
    copies those tokens' logits; any other adds its bias row. Gathering bias rows wrote, and read again,
    a row of the vocabulary per row from a table too large to stay in cache: at 8 x 32k along the
    benchmark's walks (median 4 tokens allowed) the whole step took 20-22 against 33-36 us a row.
    Exactly the bias rows added for finite logits; a NaN or inf logit of a forbidden token is -inf here
    (added to -inf, NaN)."""
    source = logits.numpy()
    out = np.empty(source.shape, dtype=np.float32)  # C order, whatever the logits' strides
    for row, index in enumerate(indices.tolist()):
        tokens = kept.get(index)
        if tokens is None:
            np.add(source[row], bias[index], out=out[row])
        else:
            out[row].fill(NEG_INF)
            out[row, tokens] = source[row, tokens]
    return torch.from_numpy(out)
