"""The bytes each token id stands for: what a constraint is matched against.

A constraint speaks about text, a model about token ids. Byte-level BPE tokenizers (GPT-2, Llama 3, the
default model) spell a token's bytes with printable stand-ins ("Ġ" is a space), SentencePiece ones with "▁"
for a space and `<0xNN>` for raw bytes; matching a constraint against those surface forms would be wrong,
so every token is mapped back to its bytes once, here. Special tokens stand for no text: `None`.

That a text is its tokens' bytes joined holds for those two kinds, and is checked for each tokenizer
(`texts_join`): every token after a plain one must decode to its bytes. Some decoders write text that is
not there (WordPiece's spaces between words, "##" joins; BPE's "</w>" word ends): no constraint is
matched against their tokens, since the text the model writes would not be the one matched.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidOption
from .locks import ForkSafeLock

_LLGUIDANCE: dict[str, Any] = {}
_llguidance_lock = ForkSafeLock()  # the server's compile threads build it (0.47 s at 32k tokens): once
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level() -> dict[str, int]:
    """GPT-2's stand-in character -> the byte it stands for (transformers' table; imported when first
    needed, so that importing the processors does not import transformers)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


@dataclass(frozen=True)
class Vocabulary:
    """`token_bytes[i]` is what token id `i` writes (None for special or unused ids); `size` is the logits width."""

    token_bytes: tuple[bytes | None, ...]
    tokenizer: Any = field(default=None, compare=False, repr=False)  # the Hugging Face tokenizer, when read from one
    texts_join: bool = field(default=True, compare=False)  # whether it writes each token as its bytes, anywhere
    decoder: str = field(default="", compare=False, repr=False)  # its decoder's name, for a refusal
    fingerprint: str = field(init=False)

    def __post_init__(self):
        digest = hashlib.sha256()
        for token in self.token_bytes:
            digest.update(b"\xff" if token is None else len(token).to_bytes(4, "little") + token)
        object.__setattr__(self, "fingerprint", digest.hexdigest()[:32])

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def check_texts_join(self) -> None:
        """Raises `InvalidOption` unless a text is its tokens' bytes joined: what a constraint on text needs."""
        if not self.texts_join:
            raise InvalidOption(f"a constraint on text cannot run over this tokenizer: its decoder ({self.decoder}) "
                                "writes text between or in place of its tokens' own (spaces between words, joins), "
                                "so the text the model writes would not be the one matched")

    def text_tokens(self) -> dict[bytes, list[int]]:
        """Every token that writes text, grouped by its bytes (several ids may write the same bytes)."""
        self.check_texts_join()
        grouped: dict[bytes, list[int]] = {}
        for token_id, token in enumerate(self.token_bytes):
            if token:
                grouped.setdefault(token, []).append(token_id)
        return grouped

    @classmethod
    def from_tokenizer(cls, tokenizer, size: int | None = None) -> "Vocabulary":
        """Reads a Hugging Face tokenizer; `size` is the model's logits width when it exceeds the tokenizer's."""
        count = len(tokenizer)
        size = max(count, size or 0)
        special = set(tokenizer.all_special_ids)
        special.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
        surfaces = tokenizer.convert_ids_to_tokens(list(range(count)))
        decoder = _decoder_config(tokenizer)
        decode = _surface_decoder(decoder)
        added = {i for i in tokenizer.added_tokens_decoder}
        token_bytes: list[bytes | None] = []
        for token_id, surface in enumerate(surfaces):
            if token_id in special or surface is None:
                token_bytes.append(None)
            elif token_id in added:  # added tokens are stored as plain text
                token_bytes.append(surface.encode("utf-8"))
            else:
                token_bytes.append(decode(surface))
        token_bytes.extend([None] * (size - count))
        return cls(tuple(token_bytes), tokenizer, texts_join=_texts_join(tokenizer, token_bytes, surfaces),
                   decoder=_decoder_name(decoder, tokenizer))

    def llguidance_tokenizer(self):
        """llguidance's view of this vocabulary (for `Grammar`), built once per vocabulary from the same bytes
        as our automata's (`llguidance_view`: llguidance's own reading of the tokenizer is not ours)."""
        self.check_texts_join()
        with _llguidance_lock:
            cached = _LLGUIDANCE.get(self.fingerprint)
            if cached is None:
                if self.tokenizer is None:
                    raise InvalidOption("a grammar needs the model's tokenizer: build the vocabulary with "
                                        "Vocabulary.from_tokenizer")
                from .llguidance_view import llguidance_tokenizer

                cached = _LLGUIDANCE[self.fingerprint] = llguidance_tokenizer(self)
        return cached


JOIN_SAMPLE = 4096  # tokens `_texts_join` decodes, at most (and the added ones)


def _texts_join(tokenizer, token_bytes: list[bytes | None], surfaces: list[str | None]) -> bool:
    """Whether every token that is whole UTF-8 decodes to its bytes after a plain token (printable ASCII with
    no space; one letter that is no `<0xNN>` byte token if there is one): then the text of any tokens is
    their bytes joined, but where a decoder drops the space that starts a whole text (SentencePiece's).
    Over a large vocabulary, `JOIN_SAMPLE` tokens spread over it and every added token are checked: the
    decoders that write other text do it to most tokens (WordPiece to every word, BPE's "</w>" to every
    word end). 1.2 ms at 1k tokens, 8 ms at 32k."""
    plain = [i for i, token in enumerate(token_bytes[: len(surfaces)]) if token and len(token) <= 2
             and surfaces[i] is not None and all(0x21 <= byte < 0x7F for byte in token)]
    if not plain:
        return False
    anchor = min(plain, key=lambda i: (bool(_BYTE_FALLBACK.fullmatch(surfaces[i])), len(token_bytes[i]),
                                       not token_bytes[i].isalpha(), i))
    count = len(surfaces)
    checked = range(count) if count <= JOIN_SAMPLE else sorted(
        set(range(0, count, count // JOIN_SAMPLE)) | {i for i in tokenizer.added_tokens_decoder if i < count})
    ids, texts = [], []
    for token_id in checked:
        token = token_bytes[token_id]
        if token:
            try:
                texts.append(token.decode("utf-8"))
            except UnicodeDecodeError:  # a byte of a character: decoders join runs of them
                continue
            ids.append(token_id)
    head = tokenizer.decode([anchor], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    pairs = [[anchor, token_id] for token_id in ids]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # transformers' decoding less its clean-up, in Rust: a tenth of the time
        decoded = backend.decode_batch(pairs, skip_special_tokens=True)
    else:
        decoded = tokenizer.batch_decode(pairs, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return all(got == head + text for got, text in zip(decoded, texts))


def _decoder_config(tokenizer) -> dict | None:
    """The decoder of a fast tokenizer's configuration (None for a slow tokenizer's)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return json.loads(backend.to_str()).get("decoder") if backend is not None else None


def _decoder_name(decoder: dict | None, tokenizer) -> str:
    if isinstance(decoder, dict) and decoder.get("type") == "Sequence":
        return " + ".join(str(step.get("type")) for step in decoder.get("decoders") or ())
    if isinstance(decoder, dict):
        return str(decoder.get("type"))
    return "none: its tokens joined by spaces" if hasattr(tokenizer, "backend_tokenizer") else type(tokenizer).__name__


def forget(fingerprint: str) -> None:
    """Drops llguidance's view of the vocabulary of `fingerprint`."""
    with _llguidance_lock:
        _LLGUIDANCE.pop(fingerprint, None)


def _surface_decoder(config: dict | None):
    """How this tokenizer spells bytes in its token strings, read from its decoder's configuration."""
    decoder = json.dumps(config) if config is not None else ""
    if "ByteLevel" in decoder:
        return _from_byte_level
    if "Metaspace" in decoder or "\u2581" in decoder or "ByteFallback" in decoder:
        return _from_sentencepiece
    return lambda surface: surface.encode("utf-8")


def _from_byte_level(surface: str) -> bytes:
    try:
        table = byte_level()
        return bytes(table[c] for c in surface)
    except KeyError:  # not a byte-level spelling: the token is plain text
        return surface.encode("utf-8")


def _from_sentencepiece(surface: str) -> bytes:
    fallback = _BYTE_FALLBACK.fullmatch(surface)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    return surface.replace("\u2581", " ").encode("utf-8")
