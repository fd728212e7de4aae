"""The tested stack (nemo_d3s/versions.py): pyproject.toml declares the same ranges, and the
start-up check refuses a version outside them with one line (faked versions), or warns under
NEMO_D3S_ALLOW_UNTESTED=1."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from nemo_d3s import versions
from nemo_d3s.errors import RunError
from _limits import WAIT_S  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _declared(lines, name, python):
    """The specifier of ``name`` among pyproject requirement ``lines`` that apply on Python
    ``python`` (exactly one must)."""
    env = {"python_version": python, "python_full_version": python + ".0", "extra": ""}
    found = [
        r
        for r in map(Requirement, lines)
        if r.name == name and (r.marker is None or r.marker.evaluate(env))
    ]
    assert len(found) == 1, (name, python, lines)
    return found[0].specifier


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_pyproject_declares_the_tested_megatron_line_of_each_python(python):
    line = next(m for m in versions.MEGATRON_LINES if SpecifierSet(m.python).contains(python))
    deps, gpu = PROJECT["dependencies"], PROJECT["optional-dependencies"]["gpu"]
    assert _declared(deps, "megatron-core", python) == SpecifierSet(line.megatron_core)
    assert _declared(gpu, "transformer-engine", python) == SpecifierSet(line.transformer_engine)
    # the gpu extra's megatron-core starts inside the same line and ends where it ends
    ours = {s.operator: s.version for s in _declared(gpu, "megatron-core", python)}
    assert SpecifierSet(line.megatron_core).contains(ours[">="])
    assert ours["<"] == next(
        s.version for s in SpecifierSet(line.megatron_core) if s.operator == "<"
    )


def test_pyproject_declares_the_tested_torch_and_vllm():
    assert _declared(PROJECT["dependencies"], "torch", "3.11") == SpecifierSet(
        versions.TESTED["torch"]
    )
    assert _declared(PROJECT["optional-dependencies"]["vllm"], "vllm", "3.12") == SpecifierSet(
        versions.TESTED["vllm"]
    )
    assert _declared(PROJECT["optional-dependencies"]["trl"], "trl", "3.11") == SpecifierSet(
        versions.TESTED["trl"]
    )


def test_the_lines_cover_each_python_once():
    for python in ("3.10", "3.11", "3.12", "3.13"):
        assert sum(SpecifierSet(m.python).contains(python) for m in versions.MEGATRON_LINES) == 1


@pytest.mark.parametrize(
    "name,version",
    [
        ("megatron-core", "0.16.1"),
        ("megatron-core", "0.15.3"),
        ("megatron-core", "0.19.2"),
        ("torch", "2.13.0+cpu"),
        ("torch", "2.15.0"),
        ("torch", "2.15.0a0+e6f2b93.nv26.10"),  # NVIDIA's base-image builds are pre-releases
        ("vllm", "0.33.0"),
        ("vllm", "0.32.0"),
    ],
)
def test_a_tested_version_passes(name, version):
    assert versions.check_stack([name], {name: version}) == []


@pytest.mark.parametrize(
    "name,version,tested",
    [
        ("megatron-core", "0.17.1", ">=0.15,<0.17 or >=0.19,<0.20"),
        ("megatron-core", "0.20.0", ">=0.15,<0.17 or >=0.19,<0.20"),
        ("torch", "2.16.0", ">=2.13,<2.16"),
        ("torch", "2.12.1", ">=2.13,<2.16"),
        ("vllm", "0.34.1", ">=0.32,<0.34"),
    ],
)
def test_an_untested_version_is_one_line_naming_both(name, version, tested, monkeypatch):
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(RunError) as e:
        versions.check_stack([name], {name: version})
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{name} {version} is installed, tested: {tested}" in msg
    assert "NEMO_D3S_ALLOW_UNTESTED=1" in msg


def test_transformer_engine_is_judged_by_the_installed_megatron_line(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    names = ["megatron-core", "transformer-engine"]
    # TE 2.14 is inside 0.19's range, outside 0.16.1's declared <2.12
    assert (
        versions.check_stack(names, {"megatron-core": "0.19.2", "transformer-engine": "2.14.0"})
        == []
    )
    with pytest.raises(
        RunError,
        match=r"transformer-engine 2\.14\.0 is installed, tested: "
        r">=2\.9\.0a0,<2\.12\.0 \(with megatron-core 0\.16\.1\)",
    ):
        versions.check_stack(names, {"megatron-core": "0.16.1", "transformer-engine": "2.14.0"})


def test_several_untested_packages_still_make_one_line(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(RunError) as e:
        versions.check_stack(["torch", "vllm"], {"torch": "2.16.0", "vllm": "0.35.0"})
    assert (
        "\n" not in str(e.value)
        and "torch 2.16.0" in str(e.value)
        and "vllm 0.35.0" in str(e.value)
    )


def test_a_package_not_installed_is_not_judged_here():
    assert versions.check_stack(["vllm", "transformer-engine"], {}) == []


def test_the_override_warns_instead(monkeypatch, caplog):
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.versions"):
        bad = versions.check_stack(["megatron-core"], {"megatron-core": "0.18.0"})
    assert bad == ["megatron-core 0.18.0 is installed, tested: >=0.15,<0.17 or >=0.19,<0.20"]
    assert "untested software: megatron-core 0.18.0" in caplog.text


def test_what_is_installed_here_is_tested():
    """CI's environments are the tested ones: the check passes on what this Python has."""
    assert versions.check_stack(["torch", "megatron-core", "transformer-engine", "vllm"]) == []


def test_a_train_run_on_an_untested_torch_stops_before_any_model_loads(tmp_path):
    """The entry point: one ``error:`` line, exit code 2 (a fake torch version through the
    distribution metadata the check reads)."""
    code = (
        "import importlib.metadata as md, sys\n"
        "real = md.version\n"
        "md.version = lambda n: '2.99.0' if n == 'torch' else real(n)\n"
        "from nemo_d3s.train import main\n"
        f"sys.argv = ['nemo-d3s-train', 'output_dir={tmp_path / 'run'}', 'trainer.steps=1']\n"
        "main()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=WAIT_S,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "torch 2.99.0 is installed, tested: >=2.13,<2.16" in errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_convert_on_an_untested_megatron_core_writes_nothing(tmp_path):
    """nemo-d3s-convert megatron-to-nemo (megatron-core writes NeMo 2): one ``error:`` line,
    its exit code 1, no output folder."""
    code = (
        "import importlib.metadata as md, sys\n"
        "real = md.version\n"
        "md.version = lambda n: '0.18.0' if n == 'megatron-core' else real(n)\n"
        "from nemo_d3s.convert.__main__ import main\n"
        f"sys.exit(main(['megatron-to-nemo', '--ckpt', {str(tmp_path / 'ck')!r}, '--out', "
        f"{str(tmp_path / 'out')!r}, '--nemo-context', {str(tmp_path / 'ctx')!r}]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=WAIT_S,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "megatron-core 0.18.0 is installed, tested:" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["false", "False", "no", "off", "0", "", "maybe"])
def test_only_a_true_like_override_lifts_the_check(monkeypatch, value):
    """NEMO_D3S_ALLOW_UNTESTED=false lifted the check like =1 (any value but "" and "0")."""
    monkeypatch.setenv(versions.ALLOW_ENV, value)
    with pytest.raises(RunError) as e:
        versions.check_stack(["megatron-core"], {"megatron-core": "0.18.0"})
    if value:
        assert f"NEMO_D3S_ALLOW_UNTESTED={value!r} keeps the check" in str(e.value)


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_a_true_like_override_warns(monkeypatch, value):
    monkeypatch.setenv(versions.ALLOW_ENV, value)
    assert versions.check_stack(["megatron-core"], {"megatron-core": "0.18.0"})
