"""What compaction saves in the TRL plugin's update: tokens and time, side by side in one run.

    python benchmarks/trl_compaction.py --out benchmarks/results/trl_compaction.json

Run it with the Python of the TRL environment. One ``D3SGRPOTrainer`` (the race's TRL
settings: ``benchmarks/vs_trl.py``, D3S with the paper's schedule and no floor) generates one
batch at each schedule position (``--progress``), and TRL's update (``compute_loss`` and its
backward, no optimizer step, so every repeat does the same work) runs on three versions of
it, in rotating order, ``--repeats`` times:

- ``full``: the whole generation batch, every completion token (TRL GRPO's update);
- ``masked``: the kept rollouts with D3S's token mask, uncompacted (``compact=False``);
- ``compacted``: the same, cut after each micro-batch's last kept token (the default).

It records the tokens each forward sees (rows x columns), the loss tokens, and the CPU
seconds (this process, ``resource.getrusage``) and wall seconds of each update, with the
machine's load average; the medians and their ratios per position.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

VARIANTS = ("full", "masked", "compacted")


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON record to write")
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--progress", default="0,0.5,1", help="schedule positions, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _model(ns) -> str:
    if ns.model:
        return ns.model
    from nemo_d3s.backends.hf.loading import resolve_model_path

    return str(resolve_model_path("smollm2-135m-instruct"))


def build(ns, out_dir: Path):
    """The trainer (keeping each generation batch before the cut as ``full``) and the
    task's problems it draws from."""
    from datasets import Dataset
    from trl import GRPOConfig

    from nemo_d3s.core.presets import D3SConfig
    from nemo_d3s.integrations.trl import D3SGRPOTrainer
    from nemo_d3s.tasks.base import make_task

    class Keeping(D3SGRPOTrainer):
        def _d3s_cut(self, output):
            self.full = dict(output)
            return super()._d3s_cut(output)

    task = make_task("basic_arithmetic", n_eval=1, seed=0, config={"max_digits": 2})
    n = ns.prompts_per_step * len(ns.progress.split(","))
    problems = task.sample_train(n, random.Random(ns.seed))

    def correct(completions, pid, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(problems[i], t) for i, t in zip(pid, texts)]

    rows = [
        {"prompt": [{"role": "user", "content": p.prompt}], "pid": i}
        for i, p in enumerate(problems)
    ]
    config = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=ns.prompts_per_step * ns.num_generations,
        num_generations=ns.num_generations,
        max_completion_length=ns.max_new_tokens,
        loss_type="dapo",
        gradient_checkpointing=False,  # as in the race (the trainer's default; TRL's is on)
        beta=0.0,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=ns.seed,
    )
    trainer = Keeping(
        model=_model(ns),
        reward_funcs=correct,
        args=config,
        train_dataset=Dataset.from_list(rows),
        d3s=D3SConfig.from_preset("d3s", min_kept_tokens=0),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer, rows


def update(trainer, batch: dict, compact: bool) -> Dict[str, float]:
    """One update's forward + backward: CPU and wall seconds, forward tokens."""
    shapes: List[tuple] = []
    hook = trainer.model.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    trainer.d3s_compact = compact
    trainer.model.zero_grad(set_to_none=True)
    w, c = time.perf_counter(), cpu_seconds()
    try:
        trainer.compute_loss(trainer.model, dict(batch)).backward()
    finally:
        hook.remove()
    cpu, wall = cpu_seconds() - c, time.perf_counter() - w
    return {"cpu_s": cpu, "wall_s": wall, "forward_tokens": sum(a * b for a, b in shapes)}


def measure(ns) -> dict:
    import torch

    torch.set_num_threads(1)
    trainer, rows = build(ns, Path(tempfile.mkdtemp(prefix="trl_compaction_")))
    G, P = ns.num_generations, ns.prompts_per_step
    points = []
    for i, p in enumerate(float(x) for x in ns.progress.split(",")):
        trainer.state.max_steps, trainer.state.global_step = 101, round(p * 100)
        trainer._step, trainer._buffered_inputs = 0, None
        torch.manual_seed(ns.seed + i)
        trainer._prepare_inputs([r for r in rows[i * P : (i + 1) * P] for _ in range(G)])
        batches = {"full": trainer.full, "masked": trainer._buffered_inputs[0]}
        batches["compacted"] = batches["masked"]
        runs: Dict[str, List[dict]] = {v: [] for v in VARIANTS}
        for r in range(ns.repeats):
            for v in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:  # rotating order
                run = update(trainer, batches[v], compact=v == "compacted")
                runs[v].append({**run, "load1": os.getloadavg()[0]})
        full, cut = batches["full"], batches["masked"]
        loss_tokens = {
            "full": int(full["completion_mask"].sum()),
            "kept": int((cut["completion_mask"] * cut["tool_mask"]).sum()),
        }
        med = {
            v: {k: statistics.median(x[k] for x in runs[v]) for k in ("cpu_s", "wall_s")}
            for v in VARIANTS
        }
        points.append(
            {
                "progress": p,
                "rows": {
                    "full": int(full["completion_ids"].shape[0]),
                    "kept": int(cut["completion_ids"].shape[0]),
                },
                "loss_tokens": loss_tokens,
                "forward_tokens": {v: runs[v][0]["forward_tokens"] for v in VARIANTS},
                "median": med,
                "cpu_ratio_masked_over_compacted": med["masked"]["cpu_s"]
                / med["compacted"]["cpu_s"],
                "cpu_ratio_full_over_compacted": med["full"]["cpu_s"] / med["compacted"]["cpu_s"],
                "runs": runs,
            }
        )
        print(json.dumps({k: v for k, v in points[-1].items() if k != "runs"}), flush=True)
    settings = {k: v for k, v in vars(ns).items() if k != "out"}
    settings.update(model=Path(_model(ns)).name, machine=platform.machine(), cpus=os.cpu_count())
    return {"settings": settings, "points": points}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(argv)
    record = measure(ns)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
