"""TRL GRPO against TRL + the D3S plugin and this trainer's GRPO, D3S, D3S-I and PODS, at equal
CPU budgets, one arm at a time.

    python benchmarks/vs_trl.py run --out runs/vs_trl --seeds 3 [--steps 20 --eval-every 5 ...]
    python benchmarks/vs_trl.py report --out runs/vs_trl --record benchmarks/results/vs_trl \\
        --doc docs/evidence.md

Run it with the Python of the TRL environment (``pip install -e ".[trl]"``; the project is
installed there too). The arms (``vs_trl_arms.ARMS``; ``--arms`` picks some) share the model,
task (``task=basic_arithmetic_2d``: the main job's reasoning-gym arithmetic), batch (prompts x
rollouts, new tokens), learning rate, seed and each step's prompts; TRL's settings match the
trainer's defaults where TRL has the knob (constant learning rate, float32, gradient clip 1,
beta 0, temperature 1, no gradient checkpointing, the ``dapo`` token mean = the trainer's
``token_mean``). What differs is
each trainer's own: TRL's advantages use std + 1e-4 (the trainer 1e-6), and each samples its
rollouts with its own RNG.

``run``: per seed, the reference (``trl_grpo``) runs ``--steps`` steps first; its training CPU
seconds (evaluation left out) are the seed's budget, and every other arm then runs until it has
spent that budget (a cheaper arm takes more steps; at most ``--max-steps-factor`` x ``--steps``,
a guard against a runaway arm set well above any arm's step-cost ratio: the cheapest step is a
skipped update, about its generation alone, ~11 CPU s against the reference's ~54 at the race's
settings, a ratio of ~5; the default is 10). A later ``run`` on a race folder may raise the
cap (never lower it) as long as no finished run stopped at it before spending its budget (such
a run would have been cut where a later one is not); ``config.json`` records the change.
Arms run one after another, never two at once (a lock refuses a second ``run`` on the same
``--out``), one thread each; ``arms.jsonl`` records each arm's start, end, exit status and CPU
seconds (``getrusage`` of the finished process), ``load.jsonl`` the load average every 30 s. Each
arm evaluates greedily on ``--eval-size`` held-out problems at step 0, every ``--eval-every``
steps and at its last. A finished arm (``done.json``) is not run again; a failed one is, from
the start; its folder and log are kept as ``<arm>_s<seed>.try<k>`` (the report does not read
them). The runner adds ``code`` to each arm's ``settings.json``: the commit of the checkout it
runs from and whether (and how: a hash of ``git diff HEAD`` and the untracked files' names)
its files differed.
``vs_trl_arms.py`` says what an arm records. A file ``STOP`` in the race folder ends
``run`` cleanly before its next arm (and is removed, so the next ``run`` goes on): a long race
can be paused without losing the arm in progress.

``report`` (``vs_trl_report.py``): the threshold is the reference's mean over its last
``--threshold-evals`` evals (per seed); time to it is read on the CPU and on the wall axis
(training only), interpolated between evals, and counts only within the seed's budget; the
docs/evidence.md section between ``<!-- vs_trl:begin -->`` and ``<!-- vs_trl:end -->`` is
regenerated from ``vs_trl.json`` alone (``--doc``; refused while runs of the race have no
``done.json``, unless ``--partial``: the section then says it is partial and which are missing).

``compaction``: ``trl_compaction.py``'s side-by-side measurement of the plugin's compaction,
written into the race folder (the report renders it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from vs_trl_arms import ARMS, REFERENCE, ended_under_budget, read_rows, run_arm  # noqa: E402
from vs_trl_report import BEGIN, END, render, replace_section, summarize, plot  # noqa: E402

__all__ = ["ARMS", "BEGIN", "END", "main", "render", "replace_section", "summarize"]

# settings every arm of a race shares (``config.json``; a later ``run`` must repeat them)
SHARED = (
    "steps",
    "eval_every",
    "prompts_per_step",
    "num_generations",
    "max_new_tokens",
    "eval_max_new_tokens",
    "eval_size",
    "eval_batch_size",
    "lr",
    "generate",
    "keep",
    "max_steps_factor",
)
DEFAULT_MAX_STEPS_FACTOR = 10.0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    p.add_argument("--steps", type=int, default=20, help="the reference's steps")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.add_argument("--eval-size", type=int, default=512)
    p.add_argument("--eval-batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--generate", type=int, default=16, help="PODS: rollouts generated a prompt")
    p.add_argument("--keep", type=int, default=4, help="PODS: rollouts kept a prompt")
    p.add_argument(
        "--max-steps-factor",
        type=float,
        default=DEFAULT_MAX_STEPS_FACTOR,
        help="an arm other than the reference stops at this x --steps steps if the budget has "
        "not stopped it first",
    )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    _common(run)
    run.add_argument("--out", required=True)
    run.add_argument("--seeds", type=int, default=3)
    run.add_argument("--first-seed", type=int, default=0)
    run.add_argument("--arms", default=",".join(ARMS))
    arm = sub.add_parser("arm", help="one arm (run starts these)")
    _common(arm)
    arm.add_argument("--name", required=True, choices=sorted(ARMS))
    arm.add_argument("--out", required=True)
    arm.add_argument("--seed", type=int, required=True)
    arm.add_argument("--budget-cpu-s", type=float, default=None)
    rep = sub.add_parser("report")
    rep.add_argument("--out", required=True)
    rep.add_argument("--threshold-evals", type=int, default=2)
    rep.add_argument("--record", default=None, help="copy the summary and records here")
    rep.add_argument("--doc", default=None, help="regenerate this file's vs_trl section")
    rep.add_argument(
        "--partial", action="store_true", help="--doc even though runs of the race are missing"
    )
    cmp_ = sub.add_parser("compaction", help="trl_compaction.py into --out/compaction.json")
    cmp_.add_argument("--out", required=True)
    cmp_.add_argument("--model", default=None)
    ns = p.parse_args(argv)
    if ns.cmd in ("run", "arm") and not 0 < ns.keep < ns.generate:
        p.error(f"--keep {ns.keep} --generate {ns.generate}: PODS keeps fewer than it generates")
    return ns


def _model(ns) -> str:
    if ns.model:
        return ns.model
    from nemo_d3s.backends.hf.loading import resolve_model_path

    return str(resolve_model_path("smollm2-135m-instruct"))


def arm_command(name: str, ns, seed: int, out: Path, budget: Optional[float]) -> List[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "arm", "--name", name]
    for k in SHARED:
        cmd += [f"--{k.replace('_', '-')}", str(getattr(ns, k))]
    cmd += ["--model", ns.model, "--seed", str(seed), "--out", str(out)]
    return cmd + ([] if budget is None else ["--budget-cpu-s", repr(budget)])


def _finished(out: Path) -> bool:
    return (out / "done.json").is_file()


def merge_race(path: Path, config: dict) -> dict:
    """``config`` for a race folder that may hold earlier calls' seeds: the ``SHARED`` settings
    and the model must be the same (else SystemExit naming the ones that differ); ``first_seed``
    / ``seeds`` then span every call's seeds and ``arms`` every call's arms."""
    if not path.is_file():
        return config
    old = json.loads(path.read_text())
    differ = sorted(k for k in (*SHARED, "model") if old.get(k) != config.get(k))
    if differ == ["max_steps_factor"]:
        config = {**config, **raise_cap(path.parent, old, float(config["max_steps_factor"]))}
        differ = []
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
    kept = {k: old[k] for k in ("max_steps_factor_changes",) if k in old and k not in config}
    return {**kept, **config, "first_seed": first, "seeds": last - first, "arms": arms_run}


def raise_cap(root: Path, old: dict, factor: float) -> dict:
    """``config.json``'s fields for a ``--max-steps-factor`` other than the race's: a higher one
    is taken when no finished run stopped at the old cap before spending its budget (raising
    it changes nothing for a run the budget stopped); a lower one, or one such run, is refused
    (SystemExit), since the finished runs would then have run under another cap than the rest."""
    was = float(old["max_steps_factor"])
    if factor < was:
        raise SystemExit(
            f"error: {root / 'config.json'}: --max-steps-factor {factor:g} is below the race's "
            f"{was:g}; a cap is only ever raised (use --max-steps-factor {was:g})"
        )
    finished, capped = [], []
    for d in sorted((root / "runs").glob("*_s*")):
        name, _, seed = d.name.rpartition("_s")
        if not seed.isdigit() or not (d / "done.json").is_file():
            continue  # a try kept aside, or a run that did not finish: it runs again
        finished.append(d.name)
        cpu = sum(float(r["cpu_s"]) for r in read_rows(d / "steps.jsonl"))
        budget = None if name == REFERENCE else budget_of(root / "runs" / f"{REFERENCE}_s{seed}")
        if ended_under_budget(budget, cpu):
            capped.append(f"{d.name} ({cpu:.0f} of {budget:.0f} CPU s)")
    if capped:
        raise SystemExit(
            f"error: {root / 'config.json'}: --max-steps-factor {factor:g} would raise the race's "
            f"cap of {was:g}, but {', '.join(capped)} stopped at it before spending the budget: "
            f"keep --max-steps-factor {was:g}, or use another --out"
        )
    change = {"from": was, "to": factor, "t": time.time(), "finished": finished}
    print(
        f"raising the race's --max-steps-factor from {was:g} to {factor:g}: none of its "
        f"{len(finished)} finished runs stopped at the cap; recorded in config.json"
    )
    return {"max_steps_factor_changes": [*old.get("max_steps_factor_changes", []), change]}


def budget_of(run: Path) -> Optional[float]:
    """The reference run's training CPU seconds (None unless it finished)."""
    if not _finished(run):
        return None
    return sum(float(r["cpu_s"]) for r in read_rows(run / "steps.jsonl"))


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def keep_try(root: Path, name: str, seed: int) -> Optional[int]:
    """Move an earlier try of ``name`` / ``seed`` that did not finish (a failed or cut run's
    folder without ``done.json``, its log) aside as ``<arm>_s<seed>.try<k>`` (the folder) and
    ``<arm>_s<seed>.try<k>.log``, k the first number free for both; the number, or None when
    there was nothing to keep."""
    base = f"{name}_s{seed}"
    run, log = root / "runs" / base, root / "logs" / f"{base}.log"
    if not run.exists() and not log.exists():
        return None
    k = 1
    while (root / "runs" / f"{base}.try{k}").exists() or (
        root / "logs" / f"{base}.try{k}.log"
    ).exists():
        k += 1
    if run.exists():
        run.rename(root / "runs" / f"{base}.try{k}")
    if log.exists():
        log.rename(root / "logs" / f"{base}.try{k}.log")
    return k


def code_version(repo: Path = REPO) -> Optional[dict]:
    """``{commit, dirty, diff_sha256, untracked}`` of the checkout ``repo``: ``git rev-parse
    HEAD``, and when tracked files differ from it or files git does not ignore are untracked, a
    hash of ``git diff HEAD`` and those files' names; None when git cannot say."""
    git = dict(cwd=repo, capture_output=True, check=True, timeout=120)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], **git).stdout.decode().strip()
        diff = subprocess.run(["git", "diff", "HEAD"], **git).stdout
        others = ["git", "ls-files", "--others", "--exclude-standard", "-z"]
        untracked = subprocess.run(others, **git).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    dirty = bool(diff or untracked)
    digest = hashlib.sha256(diff + b"\0" + untracked).hexdigest() if dirty else None
    n = len([f for f in untracked.split(b"\0") if f])
    return {"commit": head, "dirty": dirty, "diff_sha256": digest, "untracked": n}


def _record_code(out: Path, code: Optional[dict]) -> None:
    """Add ``code`` to the arm's ``settings.json`` (the arm writes that file when it starts)."""
    path = out / "settings.json"
    if path.is_file():
        path.write_text(json.dumps({**json.loads(path.read_text()), "code": code}, indent=1))


def launch(name: str, ns, seed: int, root: Path, env: dict, budget: Optional[float]) -> int:
    """Run one arm to its end (alone) and append its start, end, exit status and CPU seconds
    to ``arms.jsonl``; an earlier unfinished try is kept aside (``keep_try``), and the code
    the arm ran is added to its ``settings.json``."""
    out = root / "runs" / f"{name}_s{seed}"
    kept = keep_try(root, name, seed)
    if kept is not None:
        print(f"{name} seed {seed}: an earlier try kept as {out.name}.try{kept}")
    cmd = arm_command(name, ns, seed, out, budget)
    code = code_version()
    with (root / "logs" / f"{name}_s{seed}.log").open("w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        cpu0, start = _children_cpu(), time.time()
        exit_ = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log).wait()
        end, cpu = time.time(), _children_cpu() - cpu0
    _record_code(out, code)
    commit = None if code is None else code["commit"]
    row = {"arm": name, "seed": seed, "start": start, "end": end, "exit": exit_, "cpu_s": cpu}
    row.update(budget_cpu_s=budget, commit=commit)
    with (root / "arms.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    if exit_ != 0:
        print(f"{name} seed {seed}: exit {exit_} (log: {log.name})", file=sys.stderr)
    return exit_


class RaceLock:
    """``run.lock`` in the race folder, held with ``flock`` while a ``run`` goes on: two
    ``run`` calls on one folder would run arms at the same time. The kernel releases the lock
    when its process ends, however it ends (a kill, a restarted machine), so a stale file never
    blocks the next ``run``; the file stays (unlinking it would let two runs lock two files)."""

    def __init__(self, root: Path) -> None:
        self.path = root / "run.lock"
        self.fd: Optional[int] = None

    def __enter__(self) -> "RaceLock":
        import fcntl

        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SystemExit(
                f"error: another `run` is using this folder (pid {holder}, holding {self.path})"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def run(ns) -> int:
    ns.model = _model(ns)
    root = Path(ns.out)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    names = ns.arms.split(",")
    unknown = sorted(set(names) - set(ARMS))
    if unknown:
        raise SystemExit(f"error: --arms: unknown {unknown}; known: {', '.join(ARMS)}")
    config = {k: getattr(ns, k) for k in (*SHARED, "model", "seeds", "first_seed", "arms")}
    config.update(machine=platform.machine(), cpus=os.cpu_count())
    with RaceLock(root):
        config = merge_race(root / "config.json", config)
        (root / "config.json").write_text(json.dumps(config, indent=1))
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_load, args=(root / "load.jsonl", stop))
        sampler.start()
        failed = 0
        try:
            for name, seed in race_order(ns.first_seed, ns.seeds, names):
                if _finished(root / "runs" / f"{name}_s{seed}"):
                    continue
                budget = None
                if name != REFERENCE:
                    budget = budget_of(root / "runs" / f"{REFERENCE}_s{seed}")
                    if budget is None:
                        print(f"{name} seed {seed}: no budget (the reference did not finish)")
                        failed += 1
                        continue
                if stop_requested(root, name, seed):
                    break
                failed += launch(name, ns, seed, root, env, budget) != 0
        finally:
            stop.set()
            sampler.join()
    return 1 if failed else 0


def race_order(first_seed: int, seeds: int, names: Sequence[str]):
    """(arm, seed) in the order they run: per seed, the reference (it sets the seed's budget)
    and then the other arms of ``names``."""
    for seed in range(first_seed, first_seed + seeds):
        yield REFERENCE, seed
        yield from ((n, seed) for n in names if n != REFERENCE)


def stop_requested(root: Path, name: str, seed: int) -> bool:
    """True (and ``root/STOP`` removed) when the user asked ``run`` to end before the next arm."""
    stop = root / "STOP"
    if not stop.exists():
        return False
    stop.unlink()
    print(f"stopped before {name} seed {seed}: {stop} existed (run again to go on)")
    return True


def _sample_load(path: Path, stop: threading.Event, every_s: float = 30.0) -> None:
    """Append the machine's 1-minute load average to ``path`` every ``every_s`` seconds."""
    while not stop.is_set():
        with path.open("a") as f:
            f.write(json.dumps({"t": time.time(), "load1": os.getloadavg()[0]}) + "\n")
        stop.wait(every_s)


RECORD_FILES = ("vs_trl.json", "vs_trl.png", "config.json", "arms.jsonl", "load.jsonl")


def report(ns) -> int:
    root = Path(ns.out)
    if not (root / "config.json").is_file():
        print(f"error: --out {root}: no config.json (run `vs_trl.py run` first)", file=sys.stderr)
        return 2
    summary = summarize(root, threshold_evals=ns.threshold_evals)
    summary["record"] = ns.record or str(root)
    missing = [f"{m['arm']} seed {m['seed']} ({m['state']})" for m in summary["missing"]]
    if ns.doc and missing and not ns.partial:
        print(
            f"error: --doc: the race is incomplete, {len(missing)} of {summary['expected_runs']} "
            f"runs have no done.json ({', '.join(missing)}); --partial writes it anyway, "
            "saying so",
            file=sys.stderr,
        )
        return 2
    (root / "vs_trl.json").write_text(json.dumps(summary, indent=1))
    plot(summary, root / "vs_trl.png")
    if ns.record:
        rec = Path(ns.record)
        rec.mkdir(parents=True, exist_ok=True)
        for f in (*RECORD_FILES, "compaction.json"):
            if (root / f).is_file():
                shutil.copy(root / f, rec / f)
        copy_runs(root, rec)
    body = render(summary)
    if ns.doc:
        replace_section(Path(ns.doc), body)
    print(body)
    return 0


RUN_FILES = ("done.json", "settings.json", "steps.jsonl", "eval.jsonl")


def copy_runs(root: Path, rec: Path) -> None:
    """Every run's (kept and set aside) settings, steps, evals and log into the record, so the
    report can be made again from the record alone."""
    for d in sorted((root / "runs").glob("*_s*")):
        if rec.resolve() == root.resolve() or not d.is_dir():
            return
        (rec / "runs" / d.name).mkdir(parents=True, exist_ok=True)
        for f in RUN_FILES:
            if (d / f).is_file():
                shutil.copy(d / f, rec / "runs" / d.name / f)
        log = root / "logs" / f"{d.name}.log"
        if log.is_file():
            (rec / "logs").mkdir(exist_ok=True)
            shutil.copy(log, rec / "logs" / log.name)


def compaction(ns) -> int:
    import trl_compaction

    argv = ["--out", str(Path(ns.out) / "compaction.json")]
    return trl_compaction.main(argv + (["--model", ns.model] if ns.model else []))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(argv)
    if ns.cmd == "arm":
        ns.model = _model(ns)
        run_arm(ns)
        return 0
    return {"run": run, "report": report, "compaction": compaction}[ns.cmd](ns)


if __name__ == "__main__":
    sys.exit(main())
