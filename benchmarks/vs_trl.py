"""TRL GRPO, TRL + the D3S plugin, and this trainer's GRPO and D3S, side by side.

    python benchmarks/vs_trl.py run --out runs/vs_trl --seeds 3 [--steps 20 --eval-every 5 ...]
    python benchmarks/vs_trl.py report --out runs/vs_trl --record benchmarks/results/vs_trl \\
        --doc docs/evidence.md

Run it with the Python of the TRL environment (``pip install -e ".[trl]"``; the project is
installed there too, so the ``python -m nemo_d3s.train`` arms use the same interpreter).

``run``: for each seed, the four arms start at the same time on one machine, one thread
each (``OMP_NUM_THREADS=1``), on the same model, task (``task=basic_arithmetic_2d``: the
main job's reasoning-gym arithmetic), batch (prompts x rollouts, new tokens), learning rate
and seed:

- ``trl_grpo``: TRL's plain ``GRPOTrainer``;
- ``trl_d3s``: ``D3SGRPOTrainer(d3s="d3s")`` (nemo_d3s.integrations.trl);
- ``nd3s_grpo`` / ``nd3s_d3s``: ``python -m nemo_d3s.train d3s=grpo`` / ``d3s=d3s``.

TRL's settings are made to match the trainer's defaults where TRL has the knob (constant
learning rate, float32, gradient clip 1, beta 0, temperature 1, the ``dapo`` token mean,
which is the trainer's ``token_mean`` over kept tokens); what differs is each trainer's own
(TRL's advantages use std + 1e-4, the trainer's 1e-6; prompts are drawn from the same task by
each trainer's own sampler with the same seed, not the same prompts). The TRL arms evaluate
with greedy decoding on the task's held-out set through ``model.generate`` (a callback every
``--eval-every`` steps and at step 0), the trainer arms with their own evaluation, on the same
problems. Each arm writes ``metrics.jsonl`` (step, time_step, wall_time, update_tokens) and
``eval.jsonl`` (step, eval_reward_mean, time_eval) in the trainer's format, so one loader
(``compare_presets.load_run``) reads all four. A finished arm (``done.json`` / the
trainer's ``summary.json``) is not run again.

Memory: at 4 prompts x 8 rollouts the TRL GRPO arm's resident memory reached 7 GB (the kernel
killed it on a 24 GiB machine shared with other jobs); give the four arms about 20 GB. An arm
that dies is reported (``exit -9``) and the next ``run`` with the same ``--out`` runs it again
(finished arms are kept). ``run`` samples the machine's load average into ``load.jsonl``.

``report``: per arm, mean and 95% t interval over seeds of s/step, update (loss-carrying)
tokens per step, final eval reward, and the training wall time (evaluation left out) until
the arm's eval first reaches TRL GRPO's eval at step ``min(20, steps)`` of the same seed
(runs that never reach it are counted, not averaged); ``vs_trl.json`` + ``vs_trl.png``; with
``--doc`` the section between ``<!-- vs_trl:begin -->`` and ``<!-- vs_trl:end -->`` is
regenerated from them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from compare_presets import load_run, mean_ci, read_jsonl, time_to  # noqa: E402

ARMS = ("trl_grpo", "trl_d3s", "nd3s_grpo", "nd3s_d3s")
BEGIN, END = "<!-- vs_trl:begin -->", "<!-- vs_trl:end -->"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--eval-batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-5)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    _common(run)
    run.add_argument("--out", required=True)
    run.add_argument("--seeds", type=int, default=3)
    run.add_argument("--first-seed", type=int, default=0)
    run.add_argument("--arms", default=",".join(ARMS))
    arm = sub.add_parser("arm", help="one TRL arm (run starts these)")
    _common(arm)
    arm.add_argument("--out", required=True)
    arm.add_argument("--seed", type=int, required=True)
    arm.add_argument("--preset", default="none", help="none = TRL's plain GRPOTrainer")
    rep = sub.add_parser("report")
    rep.add_argument("--out", required=True)
    rep.add_argument("--record", default=None, help="copy vs_trl.json / .png here")
    rep.add_argument("--doc", default=None, help="regenerate this file's vs_trl section")
    return p.parse_args(argv)


def _model(ns) -> str:
    if ns.model:
        return ns.model
    from nemo_d3s.backends.hf.loading import resolve_model_path

    return str(resolve_model_path("smollm2-135m-instruct"))


def _task(ns):
    """conf/task/basic_arithmetic_2d.yaml's task (n_eval = --eval-size)."""
    from nemo_d3s.tasks.base import make_task

    return make_task("basic_arithmetic", n_eval=ns.eval_size, seed=0, config={"max_digits": 2})


# ------------------------------------------------------------------------------ TRL arm


def greedy_eval(model, tokenizer, task, ns) -> float:
    """Mean reward of greedy answers on the task's eval set (the trainer's eval, in TRL)."""
    import torch

    problems = task.eval_set()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for i in range(0, len(problems), ns.eval_batch_size):
            chunk = problems[i : i + ns.eval_batch_size]
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p.prompt}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                for p in chunk
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(model.device) for k, v in enc.items()}
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=ns.eval_max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
            answers = tokenizer.batch_decode(
                out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
            )
            total += sum(task.reward(p, a) for p, a in zip(chunk, answers))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return total / max(len(problems), 1)


def run_trl_arm(ns) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    task = _task(ns)
    batch = ns.prompts_per_step * ns.num_generations
    problems = task.sample_train(ns.steps * ns.prompts_per_step, random.Random(ns.seed))
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": p.prompt}], "pid": i}
            for i, p in enumerate(problems)
        ]
    )

    def correct(completions, pid, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(problems[i], t) for i, t in zip(pid, texts)]

    clock = {"t0": None, "last": None, "eval": 0.0, "tokens": 0.0}
    metrics_f = (out / "metrics.jsonl").open("w")
    eval_f = (out / "eval.jsonl").open("w")

    def evaluate(step: int, model, tokenizer) -> None:
        t = time.perf_counter()
        reward = greedy_eval(model, tokenizer, task, ns)
        dt = time.perf_counter() - t
        clock["eval"] += dt
        row = {"step": step, "eval_reward_mean": reward, "eval_n": ns.eval_size, "time_eval": dt}
        eval_f.write(json.dumps(row) + "\n")
        eval_f.flush()

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
            clock["t0"] = time.perf_counter()
            evaluate(0, model, processing_class)
            clock["last"] = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if "d3s/update_tokens" in logs:
                clock["step_tokens"] = float(logs["d3s/update_tokens"])
            elif "completions/mean_length" in logs:  # plain TRL: every completion token
                clock["step_tokens"] = float(logs["completions/mean_length"]) * batch

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            now = time.perf_counter()
            step = state.global_step
            clock["pending"] = (step, now - clock["last"], now - clock["t0"])
            if step % ns.eval_every == 0 or step == ns.steps:
                control.should_log = True  # the step's log (its tokens) comes before the eval
                clock["eval_after"] = (model, processing_class)
            clock["last"] = now

    class Flush(TrainerCallback):
        # after Trainer's own logging of the step (on_log above has its tokens)
        def on_log(self, args, state, control, logs=None, **kw):
            pending = clock.pop("pending", None)
            if pending is None:
                return
            step, t_step, wall = pending
            tokens = clock.get("step_tokens", float("nan"))
            clock["tokens"] += tokens
            row = {"step": step, "time_step": t_step, "wall_time": wall}
            row.update(update_tokens=tokens, update_tokens_total=clock["tokens"])
            metrics_f.write(json.dumps(row) + "\n")
            metrics_f.flush()
            after = clock.pop("eval_after", None)
            if after is not None:
                evaluate(step, *after)
                clock["last"] = time.perf_counter()

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=ns.steps,
        per_device_train_batch_size=batch,
        num_generations=ns.num_generations,
        max_completion_length=ns.max_new_tokens,
        learning_rate=ns.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        temperature=1.0,
        loss_type="dapo",
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=ns.seed,
        disable_tqdm=True,
    )
    kwargs = dict(model=_model(ns), reward_funcs=correct, args=config, train_dataset=dataset)
    kwargs["callbacks"] = [Timing(), Flush()]
    if ns.preset == "none":
        trainer = GRPOTrainer(**kwargs)
    else:
        from nemo_d3s.integrations.trl import D3SGRPOTrainer

        trainer = D3SGRPOTrainer(**kwargs, d3s=ns.preset)
    trainer.train()
    metrics_f.close()
    eval_f.close()
    (out / "done.json").write_text(json.dumps({"steps": ns.steps, "preset": ns.preset}))


# ------------------------------------------------------------------------------ run


def _shared(ns) -> List[str]:
    keys = ("steps", "eval_every", "prompts_per_step", "num_generations", "max_new_tokens")
    keys += ("eval_max_new_tokens", "eval_size", "eval_batch_size", "lr")
    args = []
    for k in keys:
        args += [f"--{k.replace('_', '-')}", str(getattr(ns, k))]
    return args


def arm_command(name: str, ns, model: str, seed: int, out: Path) -> List[str]:
    if name.startswith("trl_"):
        preset = "none" if name == "trl_grpo" else "d3s"
        cmd = [sys.executable, str(Path(__file__).resolve()), "arm", *_shared(ns)]
        return cmd + ["--model", model, "--seed", str(seed), "--preset", preset, "--out", str(out)]
    preset = name.split("_", 1)[1]
    return [
        sys.executable,
        "-m",
        "nemo_d3s.train",
        f"d3s={preset}",
        "task=basic_arithmetic_2d",
        f"model.name={model}",
        f"seed={seed}",
        f"trainer.steps={ns.steps}",
        f"trainer.eval_every={ns.eval_every}",
        f"trainer.prompts_per_step={ns.prompts_per_step}",
        f"trainer.num_generations={ns.num_generations}",
        f"trainer.max_new_tokens={ns.max_new_tokens}",
        f"trainer.eval_max_new_tokens={ns.eval_max_new_tokens}",
        f"trainer.eval_batch_size={ns.eval_batch_size}",
        f"trainer.lr={ns.lr}",
        f"task.eval_size={ns.eval_size}",
        "trainer.save_every=0",
        "trainer.export_hf=false",
        "logging.progress_bar=false",
        f"output_dir={out}",
    ]


def _finished(out: Path) -> bool:
    return (out / "done.json").is_file() or (out / "summary.json").is_file()


_PER_CALL = ("seeds", "first_seed", "arms")


def _merge_race(path: Path, config: dict) -> dict:
    """``config`` for a race folder that may hold earlier calls' seeds: the settings must be
    the same (else SystemExit naming the ones that differ), ``first_seed`` / ``seeds`` then
    span every call's seeds (a later ``run --first-seed 1 --seeds 1`` adds seed 1), and
    ``arms`` every call's arms."""
    if not path.is_file():
        return config
    old = json.loads(path.read_text())
    differ = sorted(
        k for k in set(old) | set(config) if k not in _PER_CALL and old.get(k) != config.get(k)
    )
    if differ:
        raise SystemExit(
            f"error: {path} is a race with other settings ({', '.join(differ)}): "
            "use another --out, or the same settings"
        )
    first = min(int(old["first_seed"]), int(config["first_seed"]))
    last = max(
        int(old["first_seed"]) + int(old["seeds"]), int(config["first_seed"]) + int(config["seeds"])
    )
    arms = set(str(old["arms"]).split(",")) | set(str(config["arms"]).split(","))
    arms_run = ",".join(a for a in ARMS if a in arms)  # every call's arms, in ARMS order
    return {**config, "first_seed": first, "seeds": last - first, "arms": arms_run}


def run(ns) -> int:
    model = _model(ns)
    root = Path(ns.out)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(ns).items() if k not in ("cmd", "out")}
    config.update(model=model, machine=platform.machine(), cpus=os.cpu_count())
    config = _merge_race(root / "config.json", config)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    failed = 0
    stop = threading.Event()
    threading.Thread(target=_sample_load, args=(root / "load.jsonl", stop), daemon=True).start()
    for seed in range(ns.first_seed, ns.first_seed + ns.seeds):
        procs = []
        for name in ns.arms.split(","):
            out = root / "runs" / f"{name}_s{seed}"
            if _finished(out):
                continue
            if out.exists():
                shutil.rmtree(out)  # a run cut short starts again (no resume for TRL arms)
            log = (root / "logs" / f"{name}_s{seed}.log").open("w")
            cmd = arm_command(name, ns, model, seed, out)
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            procs.append((name, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)))
        for name, proc in procs:  # all arms of a seed at the same time
            if proc.wait() != 0:
                failed += 1
                print(f"{name} seed {seed}: exit {proc.returncode}", file=sys.stderr)
    stop.set()
    return 1 if failed else 0


def _sample_load(path: Path, stop: threading.Event, every_s: float = 30.0) -> None:
    """Append the machine's 1-minute load average to ``path`` every ``every_s`` seconds: the
    arms share the machine with whatever else runs on it, and the report says how loaded it
    was (s/step is only comparable between arms of the same race)."""
    while not stop.is_set():
        with path.open("a") as f:
            f.write(json.dumps({"t": time.time(), "load1": os.getloadavg()[0]}) + "\n")
        stop.wait(every_s)


# ------------------------------------------------------------------------------ report


def summarize(root: Path) -> dict:
    config = json.loads((root / "config.json").read_text())
    step_ref = min(20, int(config["steps"]))
    runs: Dict[str, Dict[int, dict]] = {a: {} for a in ARMS}
    for d in sorted((root / "runs").glob("*_s*")):
        name, _, seed = d.name.rpartition("_s")
        if name in runs and _finished(d):
            run_ = load_run(d)
            # per step of the run, a skipped step (the trainer skips all-equal batches) as 0
            rows = read_jsonl(d / "metrics.jsonl")
            total = rows[-1].get("update_tokens_total", float("nan")) if rows else float("nan")
            run_["update_tokens_per_step"] = total / max(len(rows), 1)
            runs[name][int(seed)] = run_
    thresholds = {
        s: next((p["eval"] for p in r["curve"] if p["step"] == step_ref), None)
        for s, r in runs["trl_grpo"].items()
    }
    arms = {}
    for name, by_seed in runs.items():
        per_seed = []
        for seed, r in sorted(by_seed.items()):
            thr = thresholds.get(seed)
            per_seed.append(
                {
                    "seed": seed,
                    "s_per_step": r["step_time"],
                    "update_tokens_per_step": r["update_tokens_per_step"],
                    "eval_final": r["curve"][-1]["eval"] if r["curve"] else None,
                    "threshold": thr,
                    "time_to_threshold": None if thr is None else time_to(r["curve"], thr, "wall"),
                    "curve": r["curve"],
                }
            )
        reached = [p["time_to_threshold"] for p in per_seed if p["time_to_threshold"] is not None]
        arms[name] = {
            "runs": len(per_seed),
            "s_per_step": mean_ci([p["s_per_step"] for p in per_seed]),
            "update_tokens_per_step": mean_ci([p["update_tokens_per_step"] for p in per_seed]),
            "eval_final": mean_ci([p["eval_final"] for p in per_seed]),
            "time_to_threshold": mean_ci(reached),
            "reached": len(reached),
            "per_seed": per_seed,
        }
    loads = (
        [r["load1"] for r in read_jsonl(root / "load.jsonl")]
        if (root / "load.jsonl").is_file()
        else []
    )
    load = {"samples": len(loads)}
    if loads:
        load.update(mean=sum(loads) / len(loads), max=max(loads))
    return {"config": config, "threshold_step": step_ref, "arms": arms, "load": load}


def _fmt(mc, digits=1) -> str:
    m, h = mc
    if m != m:
        return "-"
    return f"{m:.{digits}f}" if h != h else f"{m:.{digits}f} ± {h:.{digits}f}"


def render(summary: dict) -> str:
    """The docs/evidence.md section's body, from ``vs_trl.json`` alone."""
    c = summary["config"]
    seeds = max((a["runs"] for a in summary["arms"].values()), default=0)
    lines = [
        f"Regenerated by `python benchmarks/vs_trl.py report --out <run folder> --doc "
        f"docs/evidence.md` from `benchmarks/results/vs_trl/vs_trl.json` (the run: "
        f"`python benchmarks/vs_trl.py run --steps {c['steps']} --eval-every {c['eval_every']} "
        f"--prompts-per-step {c['prompts_per_step']} --num-generations {c['num_generations']} "
        f"--max-new-tokens {c['max_new_tokens']} --eval-size {c['eval_size']} --seeds "
        f"{c['seeds']}`, model `{Path(c['model']).name}`, {c['cpus']} CPUs).",
        "",
        f"Seeds run: {seeds} per arm; intervals are 95% t over seeds (none with one seed). "
        f"Threshold: TRL GRPO's greedy eval at step {summary['threshold_step']} of the same seed; "
        "times leave evaluation out.",
        "",
    ]
    load = summary.get("load") or {}
    if load.get("samples"):
        lines += [
            f"Machine load while the arms ran (1-minute load average, {load['samples']} samples "
            f"30 s apart): mean {load['mean']:.1f}, max {load['max']:.1f}, on {c['cpus']} CPUs.",
            "",
        ]
    lines += [
        "| arm | runs | s / step | update tokens / step | final eval "
        "| time to threshold (s) | reached |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, a in summary["arms"].items():
        if not a["runs"]:
            lines.append(f"| `{name}` | 0 | not run | | | | |")
            continue
        lines.append(
            f"| `{name}` | {a['runs']} | {_fmt(a['s_per_step'])} | "
            f"{_fmt(a['update_tokens_per_step'], 0)} | {_fmt(a['eval_final'], 3)} | "
            f"{_fmt(a['time_to_threshold'])} | {a['reached']} of {a['runs']} |"
        )
    lines.append("")
    arms = summary["arms"]
    for d3s, ref in (("trl_d3s", "trl_grpo"), ("nd3s_d3s", "nd3s_grpo")):
        lines += _verdict(d3s, ref, arms[d3s]["per_seed"], arms[ref]["per_seed"])
    return "\n".join(lines)


def _verdict(d3s: str, ref: str, runs_a: List[dict], runs_b: List[dict]) -> List[str]:
    """Seed by seed (the same seed's runs of both arms; means over seeds that reached the
    threshold in one arm but not the other would compare different seeds): on how many seeds
    ``d3s`` is faster per step, and reaches the threshold sooner (an arm that never reaches it
    is later than one that does; seeds where neither does are counted apart), and on each
    seed where it is not, by how much."""
    b_by_seed = {p["seed"]: p for p in runs_b}
    pairs = [(a, b_by_seed[a["seed"]]) for a in runs_a if a["seed"] in b_by_seed]
    if not pairs:
        return []
    n = len(pairs)
    faster = sooner = neither = 0
    losses = []
    for a, b in pairs:
        what = []
        if a["s_per_step"] < b["s_per_step"]:
            faster += 1
        else:
            what.append(f"{a['s_per_step']:.1f} vs {b['s_per_step']:.1f} s/step")
        ta, tb = a["time_to_threshold"], b["time_to_threshold"]
        if ta is None and tb is None:
            neither += 1
        elif ta is not None and (tb is None or ta < tb):
            sooner += 1
        elif ta is None:
            what.append("never reaches the threshold")
        else:
            what.append(f"threshold at {ta:.0f} vs {tb:.0f} s")
        if what:
            losses.append(f"seed {a['seed']}: " + ", ".join(what))
    lines = [
        f"- `{d3s}` vs `{ref}`, seed by seed: faster per step on {faster} of {n} seeds; "
        f"reaches the threshold sooner on {sooner} of {n}"
        + (f" (neither reaches it on {neither})" if neither else "")
        + "."
    ]
    if losses:
        lines.append(f"- Where `{d3s}` does not win here: " + "; ".join(losses) + ".")
    return lines


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, a in summary["arms"].items():
        color = None
        for p in a["per_seed"]:
            xs = [q["wall"] for q in p["curve"]]
            ys = [q["eval"] for q in p["curve"]]
            (line,) = ax.plot(
                xs, ys, marker="o", color=color, alpha=0.8, label=name if color is None else None
            )
            color = line.get_color()
    ax.set_xlabel("training wall time (s, evaluation left out)")
    ax.set_ylabel("eval reward (greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_section(doc: Path, body: str) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: {doc}: no {BEGIN} ... {END} section to regenerate")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


def report(ns) -> int:
    root = Path(ns.out)
    if not (root / "config.json").is_file():
        print(f"error: --out {root}: no config.json (run `vs_trl.py run` first)", file=sys.stderr)
        return 2
    summary = summarize(root)
    (root / "vs_trl.json").write_text(json.dumps(summary, indent=1))
    plot(summary, root / "vs_trl.png")
    if ns.record:
        rec = Path(ns.record)
        rec.mkdir(parents=True, exist_ok=True)
        for f in ("vs_trl.json", "vs_trl.png", "config.json", "load.jsonl"):
            if (root / f).is_file():
                shutil.copy(root / f, rec / f)
    body = render(summary)
    if ns.doc:
        replace_section(Path(ns.doc), body)
    print(body)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(argv)
    if ns.cmd == "arm":
        run_trl_arm(ns)
        return 0
    return run(ns) if ns.cmd == "run" else report(ns)


if __name__ == "__main__":
    sys.exit(main())
