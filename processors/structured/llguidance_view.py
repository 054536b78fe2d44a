"""llguidance's view of a vocabulary, made from the vocabulary's token bytes.

llguidance can read a Hugging Face tokenizer's configuration itself, in Rust, and its masks are a third
faster that way (measured: 17-19 against 26-32 us a mask over the default vocabulary, the same masks),
since its view of our bytes calls back into Python to spell the text a grammar forces. But its own
reading is not ours: it knows fewer decoders (a plain Metaspace one, T5's and XGLM's, raised an untyped
ValueError); it spells forced text with the tokenizer's encoder, which may write other text (a
lowercasing normalizer: "forced bytes: got 'P'; applying 'p'") and turns a special token's name in a
grammar's literal ("x</s>y") into that token, which writes no text or ends the generation; and it takes
added tokens that are not special ("<tool_call>") for special ones, which no text may use. So every
vocabulary gets the view of its own bytes, whose text is then the caller's as `Vocabulary.texts_join`
checked it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .vocabulary import Vocabulary


MAX_SPELLED = 4096  # texts a view keeps the spelling of (forced texts: a grammar's literals and their tails)


class BytesView:
    """What `llguidance.TokenizerWrapper` reads: each token's bytes (a special token's name, which llguidance
    marks as special), an end-of-sequence token, and a tokenizer of bytes. The model's tokenizer is used
    where its tokens spell exactly the bytes given; a normalizer that lowercases, or a space it puts first,
    would make llguidance force other bytes than the grammar's ("forced bytes: got 'P'; applying 'p'"), so
    those bytes are then spelled in the fewest tokens that spell them exactly."""

    def __init__(self, vocabulary: Vocabulary):
        tokenizer, self._bytes = vocabulary.tokenizer, vocabulary.token_bytes
        names = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.tokens = [token if token is not None else (names[i] if i < len(names) and names[i] else f"<unused_{i}>")
                       .encode("utf-8") for i, token in enumerate(self._bytes)]
        self.special_token_ids = [i for i, token in enumerate(self._bytes) if token is None]
        # one of the vocabulary: without, llguidance adds one past it, a column the logits do not have
        self.eos_token_id = (tokenizer.eos_token_id if tokenizer.eos_token_id is not None
                             else next(iter(self.special_token_ids), 0))
        self.bos_token_id = tokenizer.bos_token_id
        backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers' encode costs ~100 us more a call
        self._encode = ((lambda text: backend.encode(text, add_special_tokens=False).ids) if backend is not None
                        else (lambda text: tokenizer.encode(text, add_special_tokens=False)))
        self._spelled: dict[bytes, list[int]] = {}  # what llguidance asked already: it asks the same texts again
        self._spelling = {token: ids[0] for token, ids in vocabulary.text_tokens().items()}  # bytes -> a token
        self._widest = max(map(len, self._spelling), default=1)

    def __call__(self, text: bytes) -> list[int]:
        """Called back from llguidance's threads, for the text a grammar forces (150 us a call measured
        through transformers' encode, most of a step's cost): each text is spelled once."""
        spelled = self._spelled.get(text)
        if spelled is None:
            if len(self._spelled) >= MAX_SPELLED:
                self._spelled.clear()
            spelled = self._spelled[text] = self._spell(text)
        return list(spelled)

    def _spell(self, text: bytes) -> list[int]:
        try:
            ids = self._encode(text.decode("utf-8"))
        except UnicodeDecodeError:
            ids = None
        if ids is not None and b"".join(self._bytes[i] or b"\xff" for i in ids) == text:
            return ids
        return self._fewest(text)

    def _fewest(self, text: bytes) -> list[int]:
        """The fewest tokens whose bytes are exactly `text` ([] when none are): a first match of the longest
        token could leave a rest no token spells ("abc" as "ab" then "c", with no "c" but "bc"). Each end
        keeps its count and last token, not its whole spelling: copies of spellings made a grammar's
        100,000-character literal cost time and memory in its length squared (1.6 s at 20,000)."""
        count: list[int | None] = [0] + [None] * len(text)  # count[i]: tokens of the best spelling of text[:i]
        last: list[tuple[int, int] | None] = [None] * (len(text) + 1)  # its last token: (where it starts, its id)
        for at in range(len(text)):
            if count[at] is None:
                continue
            for width in range(1, min(self._widest, len(text) - at) + 1):
                token_id = self._spelling.get(text[at : at + width])
                end = at + width
                if token_id is not None and (count[end] is None or count[at] + 1 < count[end]):
                    count[end], last[end] = count[at] + 1, (at, token_id)
        if count[-1] is None:
            return []
        spelled, end = [], len(text)
        while end:
            end, token_id = last[end]
            spelled.append(token_id)
        return spelled[::-1]


def llguidance_tokenizer(vocabulary: Vocabulary):
    """An `llguidance.LLTokenizer` of `vocabulary` (see the module)."""
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(BytesView(vocabulary)), n_vocab=vocabulary.size)
