#!/usr/bin/env python3
"""Do the GPU container's pins agree with each other's declared requirements?

    python slurm/container_pins.py                 # offline: check slurm/container-lock.json
    python slurm/container_pins.py --refresh DIR   # network: re-read the wheels' METADATA
                                                   # (pip download --no-deps into DIR), re-pick
                                                   # the shared dependencies, rewrite the lock

The pins are ``slurm/container-requirements.txt`` (what slurm/Dockerfile installs). The lock
records, per pinned distribution, the ``Requires-Dist`` lines of its real wheel (CPython 3.12,
manylinux x86_64: the image's platform), and, for every other package that two or more of
them (or nemo_d3s) require, the newest release on the index that satisfies all of them.

The check (no network): every requirement a pinned distribution or nemo_d3s (its
dependencies plus its ``gpu`` and ``vllm`` extras, from pyproject.toml) declares on another
pinned distribution admits the pinned version, with the markers evaluated for that platform
and the extras the pins ask for; every shared package's recorded version satisfies everyone's
specifier; the lock's pins are the requirements file's. Exit 0 when all agree, 1 with one
line per disagreement, 2 with one line naming the file (and line) when the requirements file
or the lock cannot be read as such: a line that is not a requirement, a pin with an
environment marker (the image is one platform: a marker would make the check skip it) or
a second pin of one package; a missing, truncated or garbled lock.

Not read (said in the lock): torch's own wheel (about 1 GB; its requirements are its CUDA
libraries, none of them pinned here, and everyone's requirement ON torch is checked), the
Transformer Engine core library wheel (transformer_engine_cu13, hundreds of MB; pinned ==
by the transformer-engine wheel that is read) and transformer-engine-torch (an sdist whose
metadata needs a CUDA build to produce; pinned == likewise). The full transitive resolution,
CUDA libraries included, is pip's inside ``docker build`` (it ends with ``pip check``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List, Tuple

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "container-requirements.txt"
LOCK = HERE / "container-lock.json"
PYPROJECT = HERE.parent / "pyproject.toml"
PROJECT_EXTRAS = ("gpu", "vllm")

# The image's platform (slurm/Dockerfile checks its base against it).
PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
ENV = {
    **default_environment(),
    "python_version": PYTHON,
    "python_full_version": PYTHON + ".0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
NOT_READ = {
    "torch": (
        "about 1 GB; its requirements are its own CUDA libraries (none pinned here); "
        "requirements on it are checked"
    ),
    "transformer-engine-cu13": (
        "the TE core library (hundreds of MB), pinned == by transformer-engine's METADATA"
    ),
    "transformer-engine-torch": (
        "an sdist (metadata needs a CUDA build), pinned == by transformer-engine's METADATA"
    ),
}

Pins = Dict[str, Tuple[str, Tuple[str, ...]]]  # canonical name -> (version, extras)


class PinsError(Exception):
    """A requirements file or lock that cannot be read as such (exit 2, one line)."""


def read_pins(path: Path = REQUIREMENTS) -> Pins:
    pins: Pins = {}
    lines: Dict[str, int] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PinsError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            why = str(e).splitlines()[0]
            raise PinsError(f"{path}:{n}: {line!r} is not a requirement ({why})") from None
        if req.marker is not None:
            raise PinsError(
                f"{path}:{n}: {line!r} has an environment marker; the image is one platform, so "
                "pin it without one (a marker would let the check pass it unread)"
            )
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==":
            raise PinsError(f"{path}:{n}: {line!r} is not an exact pin (name==version)")
        name = canonicalize_name(req.name)
        if name in pins:
            raise PinsError(
                f"{path}:{n}: {req.name} is pinned again (line {lines[name]} pins it too); keep one"
            )
        pins[name], lines[name] = (spec[0].version, tuple(sorted(req.extras))), n
    return pins


def read_lock(path: Path = LOCK) -> dict:
    """The lock as written by --refresh, or PinsError naming the file."""
    hint = "restore it (git checkout) or rewrite it with --refresh DIR"
    try:
        lock = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PinsError(f"{path}: no such lock file; {hint}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = str(e).splitlines()[0]
        raise PinsError(f"{path}: not a lock (truncated or garbled: {why}); {hint}") from None
    ok = (
        isinstance(lock, dict)
        and isinstance(lock.get("pins"), dict)
        and isinstance(lock.get("requires"), dict)
        and isinstance(lock.get("shared", {}), dict)
    )
    if not ok:
        raise PinsError(f"{path}: not a lock (no pins / requires tables); {hint}")
    return lock


def project_requirements(pyproject: Path = PYPROJECT) -> List[Tuple[str, str]]:
    """nemo_d3s's (requirement, extra) pairs: its dependencies ("") and PROJECT_EXTRAS."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    out = [(r, "") for r in project["dependencies"]]
    for extra in PROJECT_EXTRAS:
        out += [(r, extra) for r in project["optional-dependencies"][extra]]
    return out


def _applies(req: Requirement, extras: Tuple[str, ...]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**ENV, "extra": e}) for e in ("", *extras))


def _declared(lock: dict, pins: Pins) -> List[Tuple[str, Requirement]]:
    """(who, requirement) for every requirement that applies in the image."""
    out = []
    for name, lines in lock["requires"].items():
        version, extras = lock["pins"][name][0], tuple(lock["pins"][name][1])
        for line in lines:
            req = Requirement(line)
            if _applies(req, extras):
                out.append((f"{name}=={version}", req))
    for line, extra in project_requirements():
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**ENV, "extra": extra}):
            out.append((f"nemo_d3s{'[' + extra + ']' if extra else ''}", req))
    return out


def check(lock: dict, pins: Pins) -> List[str]:
    """One line per disagreement (empty: the pins agree)."""
    problems = []
    locked = {k: (v[0], tuple(v[1])) for k, v in lock["pins"].items()}
    if locked != pins:
        problems.append(
            f"the lock's pins {locked} are not {REQUIREMENTS.name}'s {pins}: run --refresh"
        )
    shared = lock.get("shared", {})
    for who, req in _declared(lock, pins):
        name = canonicalize_name(req.name)
        if name in pins:
            version = pins[name][0]
            if not req.specifier.contains(version, prereleases=True):
                problems.append(
                    f"{who} requires {req.name}{req.specifier} but the pin is {version}"
                )
            missing = set(req.extras) - set(pins[name][1])
            if missing:
                problems.append(
                    f"{who} requires {req.name}[{','.join(sorted(missing))}], not in the "
                    "pin's extras"
                )
        elif name in shared:
            version = shared[name]["version"]
            if version is None or not req.specifier.contains(version, prereleases=True):
                problems.append(
                    f"{who} requires {req.name}{req.specifier}; no release satisfies everyone "
                    f"({shared[name]['specifiers']})"
                )
    return problems


# ---------------------------------------------------------------------------- refresh (network)
def _pip(*args: str) -> str:
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args]
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PIP_")
    }  # no local constraints or indexes
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return r.stdout


def _requires_dist(wheel_dir: Path, name: str, version: str) -> List[str]:
    stem = re.sub(r"[-_.]+", "_", name).lower()
    wheels = [w for w in wheel_dir.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
    if not wheels:
        plat = [a for p in PLATFORMS for a in ("--platform", p)]
        _pip(
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            PYTHON,
            *plat,
            "-d",
            str(wheel_dir),
            f"{name}=={version}",
        )
        wheels = [
            w for w in wheel_dir.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")
        ]
    with zipfile.ZipFile(wheels[0]) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def _index_versions(name: str) -> List[Version]:
    out = _pip("index", "versions", name)
    m = re.search(r"Available versions: (.*)", out)
    versions = []
    for v in m.group(1).split(",") if m else []:
        try:
            versions.append(Version(v.strip()))
        except InvalidVersion:  # old releases with non-PEP 440 versions
            continue
    return sorted(versions, reverse=True)


def refresh(wheel_dir: Path, pins: Pins) -> dict:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    requires = {
        name: _requires_dist(wheel_dir, name, version)
        for name, (version, _) in pins.items()
        if name not in NOT_READ
    }
    lock = {
        "note": (
            "written by slurm/container_pins.py --refresh; read by its check (see its docstring)"
        ),
        "platform": {"python": PYTHON, "platforms": list(PLATFORMS)},
        "pins": {k: [v, list(e)] for k, v, e in ((k, *pins[k]) for k in sorted(pins))},
        "requires": requires,
        "not_read": NOT_READ,
        "shared": {},
    }
    specs: Dict[str, Dict[str, str]] = {}
    for who, req in _declared(lock, pins):
        name = canonicalize_name(req.name)
        if name not in pins:
            specs.setdefault(name, {})[who] = str(req.specifier)
    for name, by in sorted(specs.items()):
        if len(by) < 2:
            continue
        together = SpecifierSet(",".join(s for s in by.values() if s))
        version = next((str(v) for v in _index_versions(name) if together.contains(v)), None)
        lock["shared"][name] = {"version": version, "specifiers": by}
    return lock


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--refresh",
        metavar="DIR",
        help="re-read the wheels (downloaded into DIR) and rewrite the lock",
    )
    p.add_argument(
        "--lock", default=str(LOCK), help="the lock file (default: slurm/container-lock.json)"
    )
    p.add_argument(
        "--requirements",
        default=str(REQUIREMENTS),
        help="the pins (default: slurm/container-requirements.txt)",
    )
    args = p.parse_args(argv)
    try:
        pins = read_pins(Path(args.requirements))
        if args.refresh:
            lock = refresh(Path(args.refresh), pins)
            Path(args.lock).write_text(json.dumps(lock, indent=1) + "\n")
            print(f"wrote {args.lock}")
        else:
            lock = read_lock(Path(args.lock))
    except PinsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problems = check(lock, pins)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if not problems:
        print(
            f"{len(pins)} pins agree with {sum(len(v) for v in lock['requires'].values())} "
            f"declared requirements and {len(lock['shared'])} shared dependencies"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
