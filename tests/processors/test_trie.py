"""The trie walk that turns a byte-level automaton into a token-level one, against walking each token's
bytes one by one."""

from pathlib import Path

import numpy as np
import pytest

from processors.structured import trie as trie_module
from processors.structured.trie import TokenTrie, token_transitions, tokens_from


def naive(table, states, tokens_by_bytes, vocab_size):
    """Each state, each token id in order, its bytes one at a time: what the trie walk must find."""
    dead = table.shape[0] - 1
    ids = {token: text for text, group in tokens_by_bytes.items() for token in group if text}
    found = []
    for state in states:
        for token in range(vocab_size):
            if token not in ids:
                continue
            current = state
            for byte in ids[token]:
                current = table[current, byte]
                if current == dead:
                    break
            if current != dead:
                found.append((state, token, current))
    return found


def random_automaton_and_vocabulary():
    """A random automaton over a few bytes (so that most walks go somewhere) and a vocabulary with shared
    prefixes, ids writing the same bytes, single bytes and a special token (the last 3 ids write nothing)."""
    rng = np.random.default_rng(0)
    states, alphabet = 40, [0x61, 0x62, 0x63, 0xC3, 0xA9]
    table = np.full((states + 1, 256), states, dtype=np.int64)
    for byte in alphabet:
        table[:states, byte] = rng.integers(0, states + 1, states)  # some lead to the dead state
    texts = {bytes(rng.choice(alphabet, size=rng.integers(1, 7)).tolist()) for _ in range(300)} | {bytes([b]) for b in alphabet}
    tokens_by_bytes, next_id = {}, 0
    for text in sorted(texts):
        tokens_by_bytes[text] = [next_id] + ([next_id + 1] if next_id % 7 == 0 else [])  # some bytes written twice
        next_id += len(tokens_by_bytes[text])
    tokens_by_bytes[b""] = []  # a special token writes nothing and has no transition
    return states, table, tokens_by_bytes, next_id + 3


@pytest.mark.parametrize("packed_bits", [63, 0], ids=["packed", "argsort"])
@pytest.mark.parametrize("pairs_per_chunk", [1, 50, 1 << 22])
def test_the_trie_walk_finds_every_token_transition_in_order(pairs_per_chunk, packed_bits, monkeypatch):
    """Over `random_automaton_and_vocabulary`: chunks from one state at a time to all of them; sorted
    packed, and by the argsort of what does not fit packed."""
    monkeypatch.setattr(trie_module, "PAIRS_PER_CHUNK", pairs_per_chunk)
    monkeypatch.setattr(trie_module, "PACKED_BITS", packed_bits)
    states, table, tokens_by_bytes, vocab_size = random_automaton_and_vocabulary()
    walked = token_transitions(table, np.arange(states), TokenTrie.build(tokens_by_bytes), vocab_size)
    expected = naive(table, range(states), tokens_by_bytes, vocab_size)
    assert list(zip(*(part.tolist() for part in walked))) == expected
    assert 500 < len(expected) < states * (vocab_size - 3)  # the walks both end and go on


def test_an_automaton_no_token_can_enter_has_no_transitions():
    table = np.full((3, 256), 2, dtype=np.int64)
    table[0, ord("z")] = 1
    walked = token_transitions(table, np.arange(2), TokenTrie.build({b"a": [0], b"ab": [1]}), 2)
    assert all(len(part) == 0 for part in walked)


@pytest.mark.parametrize("dense_from", [10**9, 2, 8, 0], ids=["whole levels", "half-full levels", "mixed", "pair by pair"])
def test_one_state_walk_finds_the_tokens_of_the_walk_of_all(dense_from, monkeypatch):
    """`tokens_from`, whether it goes over whole levels after the first, pair by pair to the end, or
    switches on the way, finds for every state (the dead one too) the tokens the naive walk does."""
    monkeypatch.setattr(trie_module, "DENSE_FROM", dense_from)
    states, table, tokens_by_bytes, vocab_size = random_automaton_and_vocabulary()
    trie = TokenTrie.build(tokens_by_bytes)
    found = [tokens_from(table, state, trie, vocab_size) for state in range(states + 1)]
    expected = naive(table, range(states + 1), tokens_by_bytes, vocab_size)
    assert [tokens.tolist() for tokens in found] == [[t for s, t, _ in expected if s == state] for state in range(states + 1)]
    assert all(tokens.dtype == np.int32 for tokens in found)
    sizes = [len(tokens) for tokens in found[:states]]
    assert not len(found[states]) and 0 < min(sizes) < max(sizes) < vocab_size - 3  # the dead state allows nothing


def trie_of_each_depths_prefixes(tokens_by_bytes):
    """The trie's levels made the plain way: each depth's distinct prefixes, sorted, each with its parent
    among the depth above, the ids writing it, and its last byte."""
    strings, levels, above, depth = [s for s in tokens_by_bytes if s], [], [b""], 0
    while strings:
        depth += 1
        prefixes = sorted({s[:depth] for s in strings})
        parent = {prefix: index for index, prefix in enumerate(above)}
        parents = [parent[p[:-1]] for p in prefixes]
        ids = [tokens_by_bytes.get(p, []) for p in prefixes]
        levels.append(([p[-1] for p in prefixes], np.searchsorted(parents, np.arange(len(above) + 1)).tolist(),
                       np.cumsum([0] + [len(i) for i in ids]).tolist(), [t for i in ids for t in i]))
        above, strings = prefixes, [s for s in strings if len(s) > depth]
    return levels


LONG = b"=" * 20_000  # one token as long as some tokenizers' runs of a character


@pytest.mark.parametrize("vocabulary", ["random", "default", "empty", "only a special token", "a very long token"])
def test_the_trie_holds_each_depths_prefixes(vocabulary):
    """`TokenTrie.build` against each depth's distinct prefixes: the random vocabulary (ids writing the same
    bytes, a special token), the default model's (byte-level, tokens of one byte to runs of spaces), and
    the random one with a token of 20,000 bytes, sharing a prefix with others."""
    if vocabulary == "random":
        tokens_by_bytes = random_automaton_and_vocabulary()[2]
    elif vocabulary == "a very long token":
        tokens_by_bytes = {**random_automaton_and_vocabulary()[2], LONG: [10_000], LONG[:300]: [10_001], b"=": [10_002]}
    elif vocabulary == "default":
        from transformers import PreTrainedTokenizerFast

        from processors.structured import Vocabulary

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(__file__).resolve().parents[2] /
                                                               "sidecar/default_model/tokenizer.json"))
        tokens_by_bytes = Vocabulary.from_tokenizer(tokenizer, len(tokenizer)).text_tokens()
    else:
        tokens_by_bytes = {} if vocabulary == "empty" else {b"": [0]}
    built = TokenTrie.build(tokens_by_bytes)
    expected = trie_of_each_depths_prefixes(tokens_by_bytes)
    assert [(level.byte.tolist(), level.child_start.tolist(), level.end_start.tolist(), level.ends.tolist())
            for level in built.levels] == expected
    assert vocabulary != "default" or len(expected) > 8


def test_the_trie_of_a_vocabulary_with_a_very_long_token_takes_memory_as_its_bytes():
    """Building the trie holds memory in proportion to the vocabulary's bytes and levels (one a byte of the
    longest token: ~6 MB here), not to its count of tokens times its longest one (4,000 x 10,000 bytes:
    80 MB padded as uint16)."""
    import tracemalloc

    tokens_by_bytes = {f"t{i:04}".encode(): [i] for i in range(4_000)} | {LONG[:10_000]: [4_000]}
    tracemalloc.start()
    try:
        TokenTrie.build(tokens_by_bytes)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20
