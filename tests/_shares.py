"""The slow tier in K shares of about equal recorded time (``pytest --slow-share I/K``).

CI runs one share per commit and all of them with ``NEMO_D3S_CI_FULL=1`` (docs/ci.md). The
times are ``tests/slow_seconds.json`` (``{node id: seconds}``, from a run's ``--durations``
output: ``.ci/slow_seconds.py``); a test without a record counts :data:`UNRECORDED_S`. The split
is longest-first onto the share with the least time so far, so it depends only on the
collected node ids and the file: every worker of a run and every run of a commit agree.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, Iterable, Mapping, Tuple

SECONDS_FILE = Path(__file__).with_name("slow_seconds.json")
UNRECORDED_S = 60.0  # about a whole training run on the tiny model


def parse_share(text: str) -> Tuple[int, int]:
    """``"I/K"`` -> (I, K) with 0 <= I < K; ValueError naming the rule otherwise."""
    head, sep, tail = str(text).partition("/")
    try:
        i, k = int(head), int(tail)
    except ValueError:
        i = k = -1
    if not sep or k < 1 or not 0 <= i < k:
        raise ValueError(f"--slow-share {text!r}: expected I/K with 0 <= I < K (e.g. 0/4)")
    return i, k


def load_seconds(path: Path = SECONDS_FILE) -> Dict[str, float]:
    """The recorded times; an unreadable or malformed file is an error naming it."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON object of recorded test times ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object of recorded test times")
    out = {}
    for node, s in raw.items():
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            raise ValueError(f"{path}: {node!r}: {s!r} is not a time in seconds")
        out[str(node)] = float(s)
    return out


def split(nodes: Iterable[str], seconds: Mapping[str, float], k: int) -> Dict[str, int]:
    """Each node id -> its share in [0, k): longest recorded time first, each onto the share
    with the least time so far (the lowest index on a tie)."""
    cost = {n: seconds.get(n, UNRECORDED_S) for n in set(nodes)}
    load = [0.0] * k
    owner = {}
    for node in sorted(cost, key=lambda n: (-cost[n], n)):
        j = min(range(k), key=lambda s: (load[s], s))
        owner[node] = j
        load[j] += cost[node]
    return owner
