"""PROTOCOL.md against the code: every limit with its default, and every error code the server can send."""

import dataclasses
import re
from pathlib import Path

from processors.structured import budget, grammar
from processors.structured import compile as structured_compile
from protocol import Limits
from protocol import errors as protocol_errors
from sidecar import errors as engine_errors

SPEC = (Path(protocol_errors.__file__).parent / "PROTOCOL.md").read_text()


def section(number: int) -> str:
    return SPEC.split(f"\n## {number}. ")[1].split("\n## ")[0]


def test_every_limit_is_in_the_spec_with_its_default():
    rows = dict(re.findall(r"^\| `(\w+)` \| (\d+) \|", section(7), re.M))
    declared = {f.name: str(f.default) for f in dataclasses.fields(Limits)}
    # the three the processors keep for the whole process, which hello reports beside the protocol's
    declared |= {"constraint_budget_bytes": str(budget.DEFAULT_BUDGET_BYTES),
                 "constraint_cache_bytes": str(structured_compile.DEFAULT_CACHE_BYTES),
                 "grammar_step_ms": str(round(grammar.DEFAULT_STEP_LIMIT_S * 1000))}
    assert rows == declared


def test_every_error_code_is_in_the_spec():
    codes = {v for k, v in vars(protocol_errors).items() if k.isupper() and isinstance(v, str)}
    codes |= {cls.code for cls in vars(engine_errors).values()
              if isinstance(cls, type) and issubclass(cls, engine_errors.SidecarError)}
    listed = set(re.findall(r"`(\w+)`", "\n".join(line.split("|")[1] for line in section(6).splitlines() if line.startswith("| `"))))
    assert codes <= listed, f"codes missing from section 6: {sorted(codes - listed)}"
