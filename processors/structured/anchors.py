"""The anchors a whole-text match makes redundant, taken out of a regex (Rust's `regex` syntax).

A constraint matches the whole generated text, so a `^` or `\\A` that nothing can precede, and a `$` or
`\\z` that nothing can follow, always hold; outlines-core cannot compile anchors at all. They are found
on a light parse of the pattern: its tokens (escapes, classes, groups, alternations, quantifiers) and
how they nest, nothing more. An anchor with something before (or after) it, repeated, or inside a repeated
group, stays, and is refused with a clear message; so is every anchor under the multi-line (`m`) or verbose (`x`)
flag, where `^`/`$` mean lines or the text holds comments this parse does not read.

The same reading of classes says which hold syntax Rust's regex reads otherwise than JSON Schema's
(`class_read_differently`), for the schema checks.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from ..errors import InvalidOption

_TOKEN = re.compile(r"""
    (?P<escape>\\(?:[xuUpP]\{[^}]*\}|x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|[pP][A-Za-z]|.))
  | (?P<flags>\(\?[A-Za-z-]*\))
  | (?P<open>\((?:\?(?:[A-Za-z-]*:|P?<[^>]*>))?)
  | (?P<close>\))
  | (?P<alt>\|)
  | (?P<start>\^)
  | (?P<end>\$)
  | (?P<quant>(?:[*+?]|\{\d*(?:,\d*)?\})[?+]?)
  | (?P<class>\[)
  | (?P<atom>.)
""", re.VERBOSE | re.DOTALL)
_POSIX_CLASS = re.compile(r"\[:\^?[A-Za-z]+:\]")  # [:alpha:], [:^digit:]: only inside a class
_SET_SYNTAX = re.compile(r"\\.|(\[|&&|--|~~)", re.DOTALL)  # in a class: an escape, or what Rust reads as set syntax


@dataclass
class _Group:
    """Alternatives (each a list of items: token indices or groups) and whether a quantifier follows."""

    branches: list = field(default_factory=lambda: [[]])
    repeated: bool = False


@functools.lru_cache(maxsize=64)
def unanchored(pattern: str) -> str:
    """`pattern` without its redundant anchors; raises `InvalidOption` for an anchor left inside.

    Kept for the patterns last asked for: a constraint's compile key asks at every request that names it,
    and the parse of a pattern of `max_pattern_chars` takes 0.1-0.2 s."""
    tokens = _tokens(pattern)
    anchored = any(kind in ("start", "end") for kind, _ in tokens)
    if any(_sets_m_or_x(kind, text) for kind, text in tokens):
        if anchored:
            _refuse("the m or x flag")
        return pattern
    root, stack = _Group(), []
    for index, (kind, _) in enumerate(tokens):
        group = stack[-1] if stack else root
        if kind == "open":
            inner = _Group()
            group.branches[-1].append(inner)
            stack.append(inner)
        elif kind == "close" and stack:
            stack.pop()
        elif kind == "alt":
            group.branches.append([])
        elif kind == "quant" and group.branches[-1]:
            last = group.branches[-1][-1]
            if isinstance(last, _Group):
                last.repeated = True
            elif tokens[last][0] in ("start", "end"):
                _refuse("a repetition on it")
        else:
            group.branches[-1].append(index)
    dropped: set[int] = set()
    _drop(root, tokens, dropped, "start")
    _drop(root, tokens, dropped, "end")
    if any(kind in ("start", "end") and i not in dropped for i, (kind, _) in enumerate(tokens)):
        _refuse("something before or after it in the text (or a repetition around it)")
    return "".join(text for i, (_, text) in enumerate(tokens) if i not in dropped)


def _sets_m_or_x(kind: str, text: str) -> bool:
    """Whether a `(?flags)` or `(?flags:` token turns the multi-line or the verbose flag on."""
    if kind not in ("flags", "open") or not text.startswith("(?") or text[2:3] in ("P", "<"):
        return False
    return bool(set("mx") & set(text[2:].split("-")[0]))


def alternates_at_top(pattern: str) -> bool:
    """Whether the pattern holds a `|` outside every group (`a|b`, which Python's parser reads as a class)."""
    depth = 0
    for kind, _ in _tokens(pattern):
        depth += (kind == "open") - (kind == "close")
        if kind == "alt" and depth == 0:
            return True
    return False


def _tokens(pattern: str) -> list[tuple[str, str]]:
    tokens, at = [], 0
    while at < len(pattern):
        found = _TOKEN.match(pattern, at)
        kind, text = found.lastgroup, found.group()
        if kind == "class":
            text = pattern[at:_class_end(pattern, at)]
            kind = "atom"
        elif kind == "escape" and text in ("\\A", "\\z"):
            kind = "start" if text == "\\A" else "end"
        tokens.append((kind, text))
        at += len(text)
    return tokens


def class_read_differently(pattern: str) -> bool:
    """Whether a character class in `pattern` holds a `[` or a `&&`, `--`, `~~`: Rust's regex, which both
    backends use, reads `[[:alpha:]]` as a POSIX class and `[a-z&&[b-c]]` as an intersection, where JSON
    Schema's regex (ECMA-262) and Python's read literal characters."""
    at = 0
    while at < len(pattern):
        if pattern[at] == "\\":
            at += 2
        elif pattern[at] == "[":
            end = _class_end(pattern, at)
            body = at + 1 + pattern.startswith("^", at + 1)
            body += pattern.startswith("]", body)  # a ] first in the class is one of its characters
            if any(found.group(1) for found in _SET_SYNTAX.finditer(pattern, body, end)):
                return True
            at = end
        else:
            at += 1
    return False


def _class_end(pattern: str, at: int) -> int:
    """Where the class opening at `at` ends: classes nest, `]` first in one is a literal, `[:name:]` inside
    one is a POSIX class (outside, `[:a]` is the class of `:` and `a`), escapes skip."""
    depth, i = 0, at
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
        elif depth and (posix := _POSIX_CLASS.match(pattern, i)):
            i = posix.end()
        elif pattern[i] == "[":
            depth += 1
            i += 1
            i += pattern.startswith("^", i)
            i += pattern.startswith("]", i)
        elif pattern[i] == "]":
            depth -= 1
            i += 1
            if depth == 0:
                return i
        else:
            i += 1
    return len(pattern)  # unclosed: the compiler says so


def _drop(root: _Group, tokens: list, dropped: set, kind: str) -> None:
    """Marks the anchors of `kind` that open (start) or close (end) every alternative of `root`, through
    the groups that open or close them, flags groups being zero-width. A loop, not a recursion: groups
    nest as deep as `max_pattern_chars` lets them."""
    groups = [root]
    while groups:
        for branch in groups.pop().branches:
            for item in branch if kind == "start" else reversed(branch):
                if isinstance(item, _Group):
                    if not item.repeated:
                        groups.append(item)
                    break
                if tokens[item][0] == kind:
                    dropped.add(item)
                elif tokens[item][0] != "flags":
                    break


def _refuse(why: str) -> None:
    raise InvalidOption(f"option 'pattern': the whole text is matched, so an anchor (^, $, \\A, \\z) is taken only at "
                        f"the start or the end of the pattern; this one has {why}")
