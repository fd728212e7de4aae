#!/usr/bin/env python3
"""Do slurm/Dockerfile's vLLM build lines match the vLLM release they clone?

    python slurm/vllm_build.py                          # offline: check the Dockerfile
                                                        # against slurm/vllm-build.json
    python slurm/vllm_build.py --record SDIST [--wheel WHEEL]
                                                        # rewrite slurm/vllm-build.json

How the record is regenerated (network once, then offline): ::

    pip download vllm==<version> --no-deps --no-binary :all: -d /tmp/vllm_sdist
    pip download vllm==<version> --no-deps --only-binary :all: --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 -d /tmp/vllm_wheel
    python slurm/vllm_build.py --record /tmp/vllm_sdist/vllm-<version>.tar.gz \\
        --wheel /tmp/vllm_wheel/vllm-<version>-*.whl

(pip prepares the sdist's metadata after downloading it, which imports setuptools-rust and
checks the version it reports: where that fails, ``VLLM_TARGET_DEVICE=empty pip download
<the sdist's URL> --no-deps --no-build-isolation`` from an environment with setuptools >= 77
and setuptools-rust saves the same file.) The record holds facts read from the sdist, never
its files: the paths the build may name (requirements/, tools/, the top level), the build
requirements, the Rust frontend's path and switches (setup.py), the environment variables
that switch on vLLM's prebuilt kernels (vllm/envs.py), the CUDA architectures each CUDA
release supports (CMakeLists.txt), and the wheel's Rust members.

The check: the cloned ref is the record's version and the pinned one; every vLLM path the
build step names exists in the sdist; the torch lines are stripped before any requirement is
installed and the installed build requirements cover pyproject.toml's build-system ones
without naming a package the base image's freeze holds; the Rust frontend is taken from the
wheel's member into the record's path with the switch that makes a missing one fail the
build, and no variable that brings in the wheel's torch-bound kernels is set; the CUDA
architectures are named and every one is supported by CUDA 13. Exit 0 when all match, 1
with one line per mismatch, 2 with one line when the record cannot be read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Dict, List

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
RECORD = HERE / "vllm-build.json"
DOCKERFILE = HERE / "Dockerfile"
REQUIREMENTS = HERE / "container-requirements.txt"
CUDA_MAJOR = "13"  # the Dockerfile refuses a base image without CUDA 13 (nvcc --version)
# The sdist's paths a build step may name (the rest is sources the build compiles).
RECORDED_DIRS = ("requirements/", "tools/")


class RecordError(Exception):
    """A record that cannot be read as such (exit 2, one line)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _requirement_lines(text: str) -> List[str]:
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            out.append(line)
    return out


def _cuda_archs(cmake: str) -> Dict[str, List[str]]:
    """CMakeLists.txt's ``set(CUDA_SUPPORTED_ARCHS ...)`` per lowest CUDA release it applies
    to ("0" for the final else branch)."""
    out: Dict[str, List[str]] = {}
    floor = "0"
    for line in cmake.splitlines():
        m = re.search(r"CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL ([\d.]+)", line)
        if m:
            floor = m.group(1)
        elif re.match(r"\s*else\(\)", line):
            floor = "0"
        m = re.match(r'\s*set\(CUDA_SUPPORTED_ARCHS "([^"]+)"\)', line)
        if m and floor not in out:
            out[floor] = m.group(1).split(";")
    return out


def record(sdist: Path, wheel: Path | None = None) -> dict:
    """Read the facts the check needs from a vLLM sdist (and its wheel), without extracting."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}

        def text(path: str) -> str:
            f = tar.extractfile(members[path])
            return f.read().decode("utf-8")

        version = re.search(r"^Version: (\S+)$", text("PKG-INFO"), re.M).group(1)
        paths = sorted(
            p
            for p, m in members.items()
            if m.isfile() and ("/" not in p or p.startswith(RECORDED_DIRS))
        )
        build_files = [p for p in paths if p.startswith("requirements/build/")]
        setup = text("setup.py")
        envs = text("vllm/envs.py")
        pyproject = text("pyproject.toml")
        frontend = re.search(r'PRECOMPILED_RUST_FRONTEND_PATH = ROOT_DIR((?: / "[^"]+")+)', setup)
        require = re.search(r'def should_require_rust_frontend.*?os.getenv\("(\w+)"', setup, re.S)
        precompiled = re.search(r'"VLLM_USE_PRECOMPILED": lambda: \((.*?)\n    \),', envs, re.S)
        build_system = re.search(r"\[build-system\].*?requires = \[(.*?)\]", pyproject, re.S)
        toolchain = re.search(r'channel = "([^"]+)"', text("rust-toolchain.toml"))
        out = {
            "version": version,
            "sdist": {"file": Path(sdist).name, "sha256": _sha256(Path(sdist))},
            "paths": paths,
            "build_requirements": {p: _requirement_lines(text(p)) for p in build_files},
            "build_system_requires": re.findall(r'"([^"]+)"', build_system.group(1)),
            "rust": {
                "frontend": "/".join(re.findall(r'"([^"]+)"', frontend.group(1))),
                "require_switch": require.group(1),
                "toolchain": toolchain.group(1),
            },
            "precompiled_kernel_switches": sorted(
                set(re.findall(r'os.environ.get\("(\w+)"', precompiled.group(1)))
            ),
            "cuda_supported_archs": _cuda_archs(text("CMakeLists.txt")),
        }
    if wheel is not None:
        with zipfile.ZipFile(wheel) as z:
            rust = sorted(
                n for n in z.namelist() if re.fullmatch(r"vllm/(vllm-rs|_rust_[^/]*\.so)", n)
            )
        out["wheel"] = {"file": Path(wheel).name, "sha256": _sha256(Path(wheel)), "rust": rust}
    return out


def read_record(path: Path = RECORD) -> dict:
    """The committed record, or :class:`RecordError` naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"{path}: cannot be read ({e}); run --record") from None
    keys = ("version", "paths", "build_requirements", "build_system_requires", "rust", "wheel")
    if not isinstance(data, dict) or any(k not in data for k in keys):
        raise RecordError(f"{path}: not a vLLM build record (needs {', '.join(keys)})")
    return data


def build_step(dockerfile: str) -> str:
    """The Dockerfile's RUN instruction that clones vLLM, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    runs = [line for line in joined.splitlines() if line.startswith("RUN ") and "vllm" in line]
    steps = [r for r in runs if "git clone" in r]
    return steps[0] if steps else ""


def _arg(dockerfile: str, name: str) -> str | None:
    m = re.search(rf"^ARG {name}=(\"[^\"]*\"|\S+)", dockerfile, re.M)
    return m.group(1).strip('"') if m else None


def _stripped(reqs: List[str]) -> List[str]:
    return [r for r in reqs if "torch" not in r.lower()]


def _names(reqs: List[str]) -> set:
    out = set()
    for r in reqs:
        try:
            out.add(canonicalize_name(Requirement(r).name))
        except InvalidRequirement:
            out.add(r)
    return out


def check(dockerfile: str, rec: dict, pinned_vllm: str) -> List[str]:
    """One line per place the Dockerfile's vLLM build disagrees with the record."""
    problems = []
    step = build_step(dockerfile)
    if not step:
        return ["the Dockerfile has no RUN step that clones vLLM"]
    version = rec["version"]
    ref = _arg(dockerfile, "VLLM_REF")
    if ref != f"v{version}" or pinned_vllm != version:
        problems.append(
            f"the Dockerfile builds {ref}, the pin is vllm=={pinned_vllm}, the record is v{version}"
        )
    named = re.findall(r"(?<![\w/])((?:requirements|tools)/[\w./-]+)", step)
    named += re.findall(r"\bpython ([\w./-]+\.py)", step)  # scripts run from the tree
    for path in sorted(set(named)):
        if path not in rec["paths"]:
            problems.append(f"the build names {path}, which the vLLM {version} sdist lacks")
    strip = step.find("use_existing_torch.py")
    installs = [m.start() for m in re.finditer(r"pip install -r", step)]
    if strip < 0 or not installs or strip > installs[0]:
        problems.append("tools/use_existing_torch.py must run before any requirement install")
    files = re.findall(r"-r (requirements/build/[\w./-]+)", step)
    installed = [r for f in files for r in _stripped(rec["build_requirements"].get(f, []))]
    missing = _names(_stripped(rec["build_system_requires"])) - _names(installed)
    if missing:
        problems.append(
            f"the installed build requirements ({', '.join(files) or 'none'}) lack "
            f"{', '.join(sorted(missing))} of pyproject.toml's build-system"
        )
    freeze = re.search(r"grep -iE '\^\((.*?)\)=='", dockerfile)
    frozen = re.compile(rf"^({freeze.group(1)})$", re.I) if freeze else None
    for name in sorted(_names(installed)):
        if frozen and frozen.match(name):
            problems.append(
                f"a build requirement names {name}, which the base image's freeze holds"
            )
    rust = rec["rust"]["frontend"]
    if rust not in rec["wheel"]["rust"]:
        problems.append(f"the recorded wheel has no {rust}")
    if not re.search(rf"['\"]{re.escape(rust)}['\"]", step) or ".whl" not in step:
        problems.append(f"the build does not place the wheel's {rust} in the source tree")
    if f"{rec['rust']['require_switch']}=1" not in step:
        problems.append(
            f"{rec['rust']['require_switch']}=1 is not set (a missing Rust frontend would be "
            "skipped, not an error)"
        )
    for switch in rec["precompiled_kernel_switches"]:
        if switch in step or re.search(rf"^ENV .*\b{switch}=", dockerfile, re.M):
            problems.append(f"{switch} brings in the wheel's kernels built for its own torch")
    problems += _check_archs(dockerfile, step, rec["cuda_supported_archs"])
    if "--no-build-isolation ." not in step:
        problems.append("vLLM is not built without isolation (against the base's torch)")
    return problems


def _check_archs(dockerfile: str, step: str, supported: Dict[str, List[str]]) -> List[str]:
    m = re.search(r"TORCH_CUDA_ARCH_LIST=\"?\$\{(\w+)\}", step)
    archs = _arg(dockerfile, m.group(1)) if m else None
    if not archs:
        return ["TORCH_CUDA_ARCH_LIST is not set on the build (unset: every architecture)"]
    floors = [f for f in supported if f.split(".")[0] == CUDA_MAJOR]
    ok = set(supported[min(floors, key=lambda f: tuple(map(int, f.split("."))))])
    bad = [a for a in re.split(r"[;\s]+", archs) if re.sub(r"[af]?(\+PTX)?$", "", a) not in ok]
    return [f"CUDA {CUDA_MAJOR} does not support architecture {a}" for a in bad]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", type=Path, metavar="SDIST", help="rewrite the record from SDIST")
    ap.add_argument("--wheel", type=Path, help="the same release's wheel (its Rust members)")
    ap.add_argument("--dockerfile", type=Path, default=DOCKERFILE)
    ap.add_argument("--record-file", type=Path, default=RECORD)
    args = ap.parse_args(argv)
    if args.record:
        if args.wheel is None:
            ap.error("--record needs --wheel (the Rust frontend the build takes from it)")
        text = json.dumps(record(args.record, args.wheel), indent=1, sort_keys=True)
        args.record_file.write_text(text + "\n", encoding="utf-8")
        print(f"wrote {args.record_file}")
        return 0
    try:
        rec = read_record(args.record_file)
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pins = [r for r in _requirement_lines(REQUIREMENTS.read_text()) if r.startswith("vllm==")]
    problems = check(args.dockerfile.read_text(encoding="utf-8"), rec, pins[0].split("==")[1])
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"the Dockerfile's vLLM build lines match the vLLM {rec['version']} sdist")
    return 0


if __name__ == "__main__":
    sys.exit(main())
