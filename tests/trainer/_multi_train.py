"""Run several training configs in ONE torchrun launch (rank start-up dominates a 2-rank
smoke run). Usage: python -m torch.distributed.run ... tests/trainer/_multi_train.py PLAN.json
where PLAN.json is a list of override lists. The process group is created here, so each
Trainer reuses it instead of creating (and destroying) its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.trainer.conftest import compose  # noqa: E402

from nemo_d3s.trainer.loop import train  # noqa: E402


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    try:
        for overrides in plan:
            train(compose(overrides))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
