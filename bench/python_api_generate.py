"""One timed streamed generation through the Python API, for the Elixir client benchmark to compare with.

    python bench/python_api_generate.py TOKENS   ->  prints {"seconds": ..., "tokens": ...}
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sidecar import Engine  # noqa: E402

tokens = int(sys.argv[1])
engine = Engine.load()
with engine.session() as warm:
    warm.generate(token_ids=[5, 6], max_new_tokens=8, eos_token_ids=[])
with engine.session() as session:
    start = time.perf_counter()
    count = sum(1 for _ in session.stream(token_ids=[5, 6], max_new_tokens=tokens, eos_token_ids=[]))
    seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "tokens": count}))
