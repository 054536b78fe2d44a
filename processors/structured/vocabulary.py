"""The bytes each token id stands for: what a constraint is matched against.

A constraint speaks about text, a model about token ids. Byte-level BPE tokenizers (GPT-2, Llama 3, the
default model) spell a token's bytes with printable stand-ins ("Ġ" is a space), SentencePiece ones with "▁"
for a space and `<0xNN>` for raw bytes; matching a constraint against those surface forms would be wrong,
so every token is mapped back to its bytes once, here. Special tokens stand for no text: `None`.
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
    fingerprint: str = field(init=False)

    def __post_init__(self):
        digest = hashlib.sha256()
        for token in self.token_bytes:
            digest.update(b"\xff" if token is None else len(token).to_bytes(4, "little") + token)
        object.__setattr__(self, "fingerprint", digest.hexdigest()[:32])

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def text_tokens(self) -> dict[bytes, list[int]]:
        """Every token that writes text, grouped by its bytes (several ids may write the same bytes)."""
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
        decode = _surface_decoder(tokenizer)
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
        return cls(tuple(token_bytes), tokenizer)

    def llguidance_tokenizer(self):
        """llguidance's view of this vocabulary (for `Grammar`), built once per vocabulary."""
        with _llguidance_lock:
            cached = _LLGUIDANCE.get(self.fingerprint)
            if cached is None:
                if self.tokenizer is None:
                    raise InvalidOption("a grammar needs the model's tokenizer: build the vocabulary with "
                                        "Vocabulary.from_tokenizer")
                import llguidance.hf

                cached = _LLGUIDANCE[self.fingerprint] = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.size)
        return cached


def forget(fingerprint: str) -> None:
    """Drops llguidance's view of the vocabulary of `fingerprint`."""
    with _llguidance_lock:
        _LLGUIDANCE.pop(fingerprint, None)


def _surface_decoder(tokenizer):
    """How this tokenizer spells bytes in its token strings, read from its decoder's configuration."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder")) if backend is not None else ""
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
