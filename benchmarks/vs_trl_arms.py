"""The race's arms (``ARMS``) and the process that runs one (``vs_trl.py arm``).

Every arm writes the same records into its folder, read by ``vs_trl_report.py``:

- ``steps.jsonl``, one row per step: ``step``, ``t`` (epoch seconds at its end), ``wall_s`` and
  ``cpu_s`` (this process and its children, ``resource.getrusage``; evaluation left out),
  ``split`` {phase: [wall_s, cpu_s]} over generation / reward / selection / update (they sum to
  the step), ``update_tokens`` (loss-carrying), ``progress`` (the D3S schedule's), ``load1``;
- ``eval.jsonl``: ``step``, ``eval_reward_mean``, ``eval_n``, ``time_eval``;
- ``settings.json`` (what ran; ``vs_trl.py run`` adds ``code``, the commit it ran) and, last,
  ``done.json``: ``stopped`` (``steps``: the reference's ``--steps``; ``budget``: its CPU seconds
  spent; ``cap``: ``--max-steps-factor`` x ``--steps`` steps run first), ``steps``, ``cpu_s``.

How an arm stops: a TRL arm checks the budget at each step's end (``spent``, on the steps' CPU
seconds summed as ``steps.jsonl`` holds them) and says ``budget`` when that step spent it, else
``cap`` when TRL's ``max_steps`` (the cap) ended the run. A trainer arm checks at the start of
the next step (``BudgetSpent``), so when its cap step is the one that spent the budget the
trainer ends first and ``done.json`` says ``cap``. ``ended_under_budget`` is the exact reading
(the report's and the runner's): an arm with a budget that finished with fewer CPU seconds than
the budget was stopped by the cap.

How the two trainers differ beyond their settings (the report says it too):

- this trainer skips the optimizer step of a batch whose rewards are all tied (every advantage
  0) or of which nothing was kept (the step's ``skipped`` is 1, its ``update_tokens`` 0), so
  such a step costs about its generation alone (~11 CPU s at the race's settings against
  20-37 s for a step that updates); TRL runs its forward, backward and AdamW step on every
  batch, and on a zero gradient AdamW's momentum still moves the weights;
- ``update_tokens`` counts every completion token for TRL's plain GRPO (``completions/
  mean_length`` x rollouts: it has no selection) and the loss-carrying tokens for the plugin
  (``d3s/update_tokens``) and for this trainer (0 on a skipped step);
- every arm evaluates every ``--eval-every`` steps, so a cheaper arm is evaluated more often in
  CPU seconds than the reference: a first crossing between noisy evals favours it (the
  report's "held to budget" column reads the curve from the crossing to the budget instead).

The phases: in TRL, ``generation`` is ``_generate_and_score_completions`` less ``reward``
(``_calculate_rewards``) and ``selection`` (the plugin's cut, its entropy pass included);
``update`` is the rest of the step (TRL's forward, backward and optimizer step). In this trainer,
``generation`` / ``reward`` / ``update`` are its ``time_cpu_rollout`` / ``time_cpu_reward`` /
``time_cpu_update`` (+ weight sync), and ``selection`` the rest (its log-prob and entropy pass,
the selection, compaction).

The D3S schedule spans ``--steps`` in every arm (progress ``min(1, step / (steps - 1))``): an
arm that runs more steps within the budget stays at the schedule's end. The step-s prompts are
the same in every arm of a seed: ``task.sample_train(P, derive_seed(seed, "data", s))``, the
trainer's own ``PromptSource`` draw (TRL's dataset is laid out in that order, unshuffled).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from compare_presets import read_jsonl as read_rows

PHASES = ("generation", "reward", "selection", "update")
REFERENCE = "trl_grpo"


@dataclass(frozen=True)
class Arm:
    """One arm: the trainer (``trl`` / ``nd3s``), a D3S preset, D3SConfig fields changed on top
    of it, and for PODS rollouts generated (``--generate``) and kept (``--keep``) per prompt."""

    trainer: str
    preset: str
    d3s: Dict[str, Any] = field(default_factory=dict)
    pods: bool = False
    what: str = ""


ARMS: Dict[str, Arm] = {
    REFERENCE: Arm("trl", "grpo", what="TRL's plain GRPOTrainer (the reference)"),
    "trl_d3s": Arm(
        "trl",
        "d3s",
        {"min_kept_tokens": 0},
        what="TRL + the plugin: D3S, the paper's schedule, no floor, compacted",
    ),
    "nd3s_grpo": Arm("nd3s", "grpo", what="this trainer's GRPO"),
    "nd3s_d3s": Arm(
        "nd3s", "d3s", {"min_kept_tokens": 0}, what="D3S, the paper's schedule, floor off"
    ),
    "nd3s_d3s_floor": Arm("nd3s", "d3s", what="D3S, the paper's schedule, 256-token floor on"),
    "nd3s_pods": Arm(
        "nd3s",
        "pods",
        pods=True,
        what="PODS: generate --generate, keep --keep, loss averaged per sequence",
    ),
    "nd3s_d3s_i": Arm("nd3s", "d3s_i", {"min_kept_tokens": 0}, what="D3S-I, floor off"),
}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads) and its waited-for children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def cap_steps(ns) -> int:
    """The most steps an arm runs: the reference exactly ``--steps``, the others until the
    budget is spent or ``--max-steps-factor`` x ``--steps``."""
    return int(ns.steps) if ns.name == REFERENCE else int(ns.max_steps_factor * ns.steps)


def d3s_config(name: str, ns) -> Optional[dict]:
    """The arm's D3SConfig fields (None: TRL's plain trainer)."""
    arm = ARMS[name]
    if arm.trainer == "trl" and arm.preset == "grpo":
        return None
    from nemo_d3s.core.presets import D3SConfig

    fields = dict(arm.d3s)
    if arm.pods:
        fields["schedule"] = {
            **asdict(D3SConfig.from_preset(arm.preset).schedule),
            "n_init": int(ns.keep),
            "n_final": int(ns.keep),
        }
    cfg = asdict(D3SConfig.from_preset(arm.preset, **fields))
    cfg["schedule"] = dict(cfg["schedule"])
    return cfg


def num_generations(name: str, ns) -> int:
    return int(ns.generate) if ARMS[name].pods else int(ns.num_generations)


def nd3s_overrides(name: str, ns, model: str, out: Path) -> List[str]:
    """``python -m nemo_d3s.train`` overrides of a trainer arm (``trainer.steps``: its cap)."""
    arm = ARMS[name]
    over = [f"d3s={arm.preset}"] + [f"d3s.{k}={v}" for k, v in arm.d3s.items()]
    if arm.pods:
        over += [f"d3s.schedule.n_init={int(ns.keep)}", f"d3s.schedule.n_final={int(ns.keep)}"]
        over += ["algorithm.aggregation=seq_mean_token_mean"]  # the PODS papers' loss
    return over + [
        "task=basic_arithmetic_2d",
        f"model.name={model}",
        f"seed={ns.seed}",
        f"trainer.steps={cap_steps(ns)}",
        f"trainer.eval_every={ns.eval_every}",
        f"trainer.prompts_per_step={ns.prompts_per_step}",
        f"trainer.num_generations={num_generations(name, ns)}",
        f"trainer.max_new_tokens={ns.max_new_tokens}",
        f"trainer.eval_max_new_tokens={ns.eval_max_new_tokens}",
        f"trainer.eval_batch_size={ns.eval_batch_size}",
        f"trainer.lr={ns.lr}",
        f"task.eval_size={ns.eval_size}",
        "trainer.save_every=0",
        "trainer.export_hf=false",
        "logging.progress_bar=false",
        f"output_dir={out / 'trainer'}",  # a folder of its own: it refuses foreign files
    ]


class Meter:
    """Wall and CPU seconds since the last ``lap`` or ``reset``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.wall, self.cpu = time.perf_counter(), cpu_seconds()

    def lap(self) -> tuple:
        wall, cpu = time.perf_counter(), cpu_seconds()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


class PhaseClock:
    """Wall and CPU seconds accumulated per named phase until ``take``."""

    def __init__(self) -> None:
        self.acc: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0])

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), cpu_seconds()
        try:
            yield
        finally:
            self.acc[name][0] += time.perf_counter() - wall
            self.acc[name][1] += cpu_seconds() - cpu

    def take(self) -> Dict[str, List[float]]:
        out = {k: list(v) for k, v in self.acc.items()}
        self.acc.clear()
        return out


class Records:
    """The arm's ``steps.jsonl`` / ``eval.jsonl`` / ``done.json`` (lines flushed as written)."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.cpu_total = 0.0
        self.steps = 0

    def _append(self, name: str, row: dict) -> None:
        with (self.out / name).open("a") as f:
            f.write(json.dumps(row) + "\n")

    def step(self, step: int, wall: float, cpu: float, split: Dict[str, List[float]], **kw) -> None:
        self.cpu_total += cpu
        self.steps = step
        row = {"step": step, "t": time.time(), "wall_s": wall, "cpu_s": cpu, "split": split}
        self._append("steps.jsonl", {**row, **kw, "load1": os.getloadavg()[0]})

    def eval(self, step: int, reward: float, n: int, seconds: float) -> None:
        row = {"step": step, "eval_reward_mean": reward, "eval_n": n, "time_eval": seconds}
        self._append("eval.jsonl", row)

    def done(self, stopped: str) -> None:
        row = {"stopped": stopped, "steps": self.steps, "cpu_s": self.cpu_total}
        (self.out / "done.json").write_text(json.dumps(row))


def spent(budget: Optional[float], cpu: float) -> bool:
    return budget is not None and cpu >= budget


def ended_under_budget(budget: Optional[float], cpu: float) -> bool:
    """A finished arm with a budget that spent less than it: the cap stopped it (``cpu``: its
    steps' CPU seconds summed in order, as the arm summed them for ``spent``)."""
    return budget is not None and not spent(budget, cpu)


def progress_at(step: int, horizon: int) -> float:
    """The D3S schedule's position at 0-based ``step`` of a ``horizon``-step schedule."""
    return min(1.0, step / max(1, horizon - 1))


def task_of(ns):
    """conf/task/basic_arithmetic_2d.yaml's task (n_eval = --eval-size)."""
    from nemo_d3s.tasks.base import make_task

    return make_task("basic_arithmetic", n_eval=ns.eval_size, seed=0, config={"max_digits": 2})


def step_problems(task, ns, steps: int) -> list:
    """The prompts of steps 0..steps-1 in order, as the trainer's ``PromptSource`` draws them."""
    from nemo_d3s.trainer.data import derive_seed

    P = int(ns.prompts_per_step)
    return [p for s in range(steps) for p in task.sample_train(P, derive_seed(ns.seed, "data", s))]


def write_settings(out: Path, name: str, ns, **extra) -> None:
    arm = ARMS[name]
    row = {"arm": name, **asdict(arm), "d3s_config": d3s_config(name, ns)}
    row.update(num_generations=num_generations(name, ns), cap_steps=cap_steps(ns))
    row.update(budget_cpu_s=ns.budget_cpu_s, schedule_steps=int(ns.steps), **extra)
    (out / "settings.json").write_text(json.dumps(row, indent=1))


def run_arm(ns) -> None:
    """The arm ``ns.name`` into ``ns.out``: stops at ``ns.budget_cpu_s`` CPU seconds of training
    (None: at ``--steps``), or at its cap."""
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    if ARMS[ns.name].trainer == "trl":
        run_trl_arm(ns, out)
    else:
        run_nd3s_arm(ns, out)


# ------------------------------------------------------------------------------ TRL


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


def timed_trainer(base, clock: PhaseClock, horizon: int):
    """``base`` (TRL's trainer class) with its step's phases timed into ``clock`` and, for the
    plugin, the D3S schedule spanning ``horizon`` steps."""

    class Timed(base):
        def _generate_and_score_completions(self, inputs):
            with clock.timed("generate_and_score"):
                return super()._generate_and_score_completions(inputs)

        def _calculate_rewards(self, *args, **kwargs):
            with clock.timed("reward"):
                return super()._calculate_rewards(*args, **kwargs)

        if hasattr(base, "_d3s_cut"):

            def _d3s_cut(self, output):
                with clock.timed("selection"):
                    return super()._d3s_cut(output)

            def _d3s_progress(self) -> float:
                return progress_at(self.state.global_step, horizon)

    return Timed


def trl_split(phases: Dict[str, List[float]], wall: float, cpu: float) -> Dict[str, List[float]]:
    """The step's [wall, cpu] per phase, summing to the step (see the module docstring)."""
    zero = [0.0, 0.0]
    gs, rew, sel = (phases.get(k, zero) for k in ("generate_and_score", "reward", "selection"))
    return {
        "generation": [gs[i] - rew[i] - sel[i] for i in (0, 1)],
        "reward": list(rew),
        "selection": list(sel),
        "update": [wall - gs[0], cpu - gs[1]],
    }


def run_trl_arm(ns, out: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    task, cap, budget = task_of(ns), cap_steps(ns), ns.budget_cpu_s
    G, P = num_generations(ns.name, ns), int(ns.prompts_per_step)
    problems = step_problems(task, ns, cap)
    rows = [
        {"prompt": [{"role": "user", "content": p.prompt}], "pid": i}
        for i, p in enumerate(problems)
    ]
    seen: List[int] = []

    def correct(completions, pid, **kw):
        seen.extend(pid)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(problems[i], t) for i, t in zip(pid, texts)]

    rec, meter, clock = Records(out), Meter(), PhaseClock()
    pending: Dict[str, Any] = {}

    def evaluate(step: int, model, tokenizer) -> None:
        t = time.perf_counter()
        reward = greedy_eval(model, tokenizer, task, ns)
        rec.eval(step, reward, len(task.eval_set()), time.perf_counter() - t)
        meter.reset()  # evaluation is not training time

    class Race(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
            evaluate(0, model, processing_class)
            clock.take()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            wall, cpu = meter.lap()
            step = state.global_step
            stop = spent(budget, rec.cpu_total + cpu)
            if stop:
                control.should_training_stop = True
            pending.update(step=step, wall=wall, cpu=cpu, split=trl_split(clock.take(), wall, cpu))
            pending["prompt0"] = min(seen) if seen else None
            seen.clear()
            if stop or step % ns.eval_every == 0 or step == cap:
                pending["eval"] = (model, processing_class)
            pending["stopped"] = "budget" if stop else ("steps" if budget is None else "cap")
            control.should_log = True  # the step's log (its tokens) comes before the eval

        def on_log(self, args, state, control, logs=None, **kw):
            if "step" not in pending:
                return
            logs = logs or {}
            if "d3s/update_tokens" in logs:
                tokens = float(logs["d3s/update_tokens"])
            else:  # plain TRL: every completion token
                tokens = float(logs.get("completions/mean_length", float("nan"))) * P * G
            extra = {"update_tokens": tokens, "prompt0": pending["prompt0"]}
            if "d3s/forward_token_share" in logs:
                extra["forward_token_share"] = float(logs["d3s/forward_token_share"])
            step = pending["step"]
            extra["progress"] = progress_at(step - 1, int(ns.steps))
            rec.step(step, pending["wall"], pending["cpu"], pending["split"], **extra)
            if "eval" in pending:
                evaluate(step, *pending["eval"])
            self.stopped = pending["stopped"]
            pending.clear()

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=cap,
        per_device_train_batch_size=P * G,
        num_generations=G,
        max_completion_length=ns.max_new_tokens,
        learning_rate=ns.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        temperature=1.0,
        loss_type="dapo",
        gradient_checkpointing=False,  # the trainer's default (TRL turns it on)
        shuffle_dataset=False,  # step s trains on rows [s P, (s + 1) P): step_problems' order
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=ns.seed,
        disable_tqdm=True,
    )
    race = Race()
    kwargs = dict(model=ns.model, reward_funcs=correct, args=config, callbacks=[race])
    kwargs["train_dataset"] = Dataset.from_list(rows)
    cfg = d3s_config(ns.name, ns)
    if cfg is None:
        trainer = timed_trainer(GRPOTrainer, clock, int(ns.steps))(**kwargs)
    else:
        from nemo_d3s.integrations.trl import D3SGRPOTrainer

        trainer = timed_trainer(D3SGRPOTrainer, clock, int(ns.steps))(**kwargs, d3s=cfg)
    keys = ("max_steps", "per_device_train_batch_size", "num_generations", "learning_rate")
    keys += ("max_completion_length", "loss_type", "beta", "temperature", "max_grad_norm")
    keys += ("gradient_checkpointing", "shuffle_dataset")
    write_settings(out, ns.name, ns, trl={k: getattr(config, k) for k in keys})
    meter.reset()
    trainer.train()
    rec.done(getattr(race, "stopped", "steps"))


# ------------------------------------------------------------------------------ this trainer


class BudgetSpent(Exception):
    """Raised at the start of the step after the CPU budget was spent."""


def run_nd3s_arm(ns, out: Path) -> None:
    """``python -m nemo_d3s.train`` with the arm's overrides, its ``run_step`` wrapped to time
    the step, hold the schedule to ``--steps`` and stop at the budget. The step that spends the
    budget evaluates (as the trainer does at its last step) before it returns, while the
    trainer's engine and reward pool are still open: ``trainer.run`` closes them on its way out
    (a post-run eval met "the reward pool is closed" in the first race). Its time is the
    eval's, not the step's."""
    from nemo_d3s.train import EXIT_INTERRUPTED, compose_config
    from nemo_d3s.trainer import loop
    from nemo_d3s.trainer.evaluate import evaluate

    cfg = compose_config(nd3s_overrides(ns.name, ns, ns.model, out))
    rec, budget, horizon, cap = Records(out), ns.budget_cpu_s, int(ns.steps), cap_steps(ns)
    inner = loop.run_step
    last_eval: List[tuple] = []  # (reward mean, n, seconds) of the budget's last step

    def run_step(ctx, step, progress):
        if spent(budget, rec.cpu_total):
            raise BudgetSpent()
        p = progress_at(step, horizon)
        meter = Meter()
        m = inner(ctx, step, p)
        wall, cpu = meter.lap()
        m["progress"] = p
        named = {
            "generation": ("rollout",),
            "reward": ("reward",),
            "update": ("update", "weight_sync", "reference"),
        }
        split = {
            k: [
                sum(m.get(f"time_{n}", 0.0) for n in v),
                sum(m.get(f"time_cpu_{n}", 0.0) for n in v),
            ]
            for k, v in named.items()
        }
        split["selection"] = [
            total - sum(x[i] for x in split.values()) for i, total in ((0, wall), (1, cpu))
        ]
        tokens = float(m.get("update_tokens", 0.0))
        rec.step(
            step + 1,
            wall,
            cpu,
            split,
            update_tokens=tokens,
            progress=p,
            skipped=m.get("skipped", 0.0),
        )
        if spent(budget, rec.cpu_total) and rec.steps % int(ns.eval_every) and rec.steps < cap:
            # the trainer evaluates at multiples of eval_every and at its last step (the cap)
            # only; the run stops before the next
            res = evaluate(
                trainer.engine,
                trainer.task,
                trainer.eval_problems,
                trainer.groups,
                max_new_tokens=int(ns.eval_max_new_tokens),
                batch_size=int(ns.eval_batch_size),
            )
            last_eval.append((res["eval_reward_mean"], res["eval_n"], res["time_eval"]))
        return m

    write_settings(out, ns.name, ns, overrides=nd3s_overrides(ns.name, ns, ns.model, out))
    loop.run_step = run_step
    loop.seed_everything(int(cfg.seed))
    trainer = loop.Trainer(cfg)
    try:
        if trainer.run().extra.get("interrupted"):
            # a stop signal ended the trainer at a checkpoint: not a finished arm (no
            # done.json, so the next `run` runs it again); the trainer's own exit code
            raise SystemExit(EXIT_INTERRUPTED)
        stopped = "steps" if budget is None else "cap"
    except BudgetSpent:
        stopped = "budget"
    finally:
        trainer.groups.shutdown()
    for row in read_rows(out / "trainer" / "eval.jsonl"):
        rec.eval(row["step"], row["eval_reward_mean"], row["eval_n"], row["time_eval"])
    for reward, n, seconds in last_eval:
        rec.eval(rec.steps, reward, n, seconds)
    rec.done(stopped)
