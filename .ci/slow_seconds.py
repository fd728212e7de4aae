#!/usr/bin/env python3
"""Update tests/slow_seconds.json (the slow tier's recorded times, tests/_shares.py) from the
``--durations`` lines of pytest logs: ``python .ci/slow_seconds.py LOG [LOG ...]``.

A test's time is the sum of its setup, call and teardown lines in the newest log naming it;
tests no log names keep their record. Only tests of at least one second are kept.
"""

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)s (?:setup|call|teardown)\s+(\S+::\S+)\s*$")
FILE = Path(__file__).resolve().parent.parent / "tests" / "slow_seconds.json"


def main(logs):
    if not logs:
        sys.exit("usage: python .ci/slow_seconds.py LOG [LOG ...]")
    record = json.loads(FILE.read_text()) if FILE.exists() else {}
    for log in logs:
        seen = {}
        for line in Path(log).read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                seen[m.group(2)] = seen.get(m.group(2), 0.0) + float(m.group(1))
        record.update({node: round(s, 1) for node, s in seen.items()})
    record = {node: s for node, s in sorted(record.items()) if s >= 1.0}
    FILE.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{FILE}: {len(record)} tests, {sum(record.values()):.0f} s recorded")


if __name__ == "__main__":
    main(sys.argv[1:])
