#!/usr/bin/env python3
"""Do the GPU container's pins, its base image's torch and Transformer Engine, and nemo_d3s
resolve together?

    python slurm/container_pins.py                 # offline: check slurm/container-lock.json
    python slurm/container_pins.py --refresh DIR   # network: re-read the wheels' METADATA
                                                   # (pip download --no-deps into DIR), re-pick
                                                   # the shared dependencies, re-run the pip
                                                   # resolution, rewrite the lock
    python slurm/container_pins.py --check-base    # inside the image: its torch and TE lie
                                                   # inside BASE (slurm/Dockerfile runs it)

The pins are ``slurm/container-requirements.txt`` (what slurm/Dockerfile installs on top of
the NGC base image); the base provides torch and Transformer Engine (:data:`BASE`: the ranges
the image's own builds must lie in). vLLM is built from source against the base's torch: its
requirements are its wheel's minus every line naming torch (:data:`SOURCE_BUILT`, what vLLM's
``use_existing_torch.py`` removes from its requirements files).

The lock records, per pinned distribution, the ``Requires-Dist`` lines of its real wheel
(CPython 3.12, manylinux x86_64: the image's platform); for every other package that two or
more of them (or nemo_d3s) require, the newest release satisfying all of them; the releases
on the index inside each BASE range; and ``resolved``: what ``pip install --dry-run
--report`` (no local pip configuration) installs for the source-built vLLM's requirements,
the other pins and nemo_d3s's dependencies, with a PyPI torch standing in for the base's at
each end of BASE's torch range (``--refresh`` runs it with Python 3.12). That is the proof
that the set resolves (TE, the base's, is left out of it: its PyPI torch extension is an
sdist that needs CUDA to build).

The check (no network): every requirement a pinned distribution or nemo_d3s (its
dependencies plus its ``gpu`` and ``vllm`` extras, from pyproject.toml) declares on another
pinned distribution admits the pinned version, and on a base-provided one admits every
recorded release inside BASE, with the markers evaluated for that platform and the extras
the pins ask for; every shared package's recorded version satisfies everyone's specifier;
each resolution holds every pin at its version; the lock's pins and BASE are the ones here.
Exit 0 when all agree, 1 with one line per disagreement, 2 with one line naming the file (and
line) when the requirements file or the lock cannot be read as such: a line that is not a
requirement, a pin with an environment marker (the image is one platform: a marker would make
the check skip it) or a second pin of one package; a missing, truncated or garbled lock.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
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

# What the NGC base image provides (kept, never replaced): distribution -> the range its
# version must lie in. torch: vLLM 0.33.0 is written for torch 2.14 (its wheel pins
# ==2.14.0) and nemo_d3s is tested to 2.15 (nemo_d3s/versions.py TESTED); NVIDIA's builds
# are pre-releases (2.15.0a0+<commit>), admitted. transformer-engine: megatron-core 0.19's line
# in nemo_d3s/versions.py. tests/test_container.py checks both against that module.
BASE = {"torch": ">=2.14.0a0,<2.16", "transformer-engine": ">=2.9.0a0,<2.21.0"}
# Pinned distributions built from source against the base: their wheel's requirements minus
# every line naming this word (vLLM's use_existing_torch.py does that to its requirement files).
SOURCE_BUILT = {"vllm": "torch"}
NOT_READ = {
    "torch": "the base image's build is used, not PyPI's; requirements on it are checked "
    "against BASE",
    "transformer-engine": "the base image's build is used (PyPI's torch extension is an sdist); "
    "requirements on it are checked against BASE",
}

# The image's platform (slurm/Dockerfile checks its base against it): CPython 3.12 on glibc
# >= 2.35 (NGC's PyTorch images are Ubuntu 22.04 or later; vLLM's llguidance needs 2.31).
PYTHON = "3.12"
GLIBC = (2, 35)
PLATFORMS = tuple(f"manylinux_2_{m}_x86_64" for m in range(GLIBC[1], 16, -1)) + (
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
        and isinstance(lock.get("base", {}), dict)
        and isinstance(lock.get("resolved", {}), dict)
    )
    if not ok:
        raise PinsError(f"{path}: not a lock (no pins / requires tables); {hint}")
    bad = _bad_row(lock)
    if bad:
        raise PinsError(f"{path}: not a lock ({bad}); {hint}")
    return lock


def _strs(x, n=None) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x) and n in (None, len(x))


def _str_map(x) -> bool:
    return isinstance(x, dict) and all(isinstance(v, str) for v in x.values())


# The shape of each table's rows, as --refresh writes them, and the words that name it.
_ROWS = {
    "pins": (lambda v: isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
             and _strs(v[1]), "[version, [extras]]"),
    "requires": (_strs, "a list of requirement lines"),
    "shared": (lambda v: isinstance(v, dict) and isinstance(v.get("version"), str)
               and _str_map(v.get("specifiers")), "{version, specifiers}"),
    "base": (lambda v: isinstance(v, dict) and isinstance(v.get("range"), str)
             and _strs(v.get("releases")), "{range, releases}"),
    "resolved": (_str_map, "{distribution: version}"),
}  # fmt: skip


def _bad_row(lock: dict) -> str:
    """The first row of a table that is not of the shape --refresh writes ("" when none)."""
    for table, (ok, shape) in _ROWS.items():
        for key, row in lock.get(table, {}).items():
            if not ok(row):
                return f"{table}[{key!r}] is {json.dumps(row)[:60]}, not {shape}"
    return ""


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


def _built_requires(name: str, lines: List[str]) -> List[str]:
    """What a pinned distribution requires as the image installs it (a source build drops the
    lines naming its word)."""
    word = SOURCE_BUILT.get(name)
    return [line for line in lines if word is None or word not in line.lower()]


def _declared(lock: dict, pins: Pins) -> List[Tuple[str, Requirement]]:
    """(who, requirement) for every requirement that applies in the image."""
    out = []
    for name, lines in lock["requires"].items():
        version, extras = lock["pins"][name][0], tuple(lock["pins"][name][1])
        for line in _built_requires(name, lines):
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
    base = lock.get("base", {})
    if {k: v["range"] for k, v in base.items()} != BASE:
        problems.append(f"the lock's base ranges are not BASE {BASE}: run --refresh")
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
        elif name in BASE:
            releases = base.get(name, {}).get("releases", [])
            outside = [v for v in releases if not req.specifier.contains(v, prereleases=True)]
            if outside or not releases:
                problems.append(
                    f"{who} requires {req.name}{req.specifier} but the base image may have "
                    f"{name} {', '.join(outside) or '(no release recorded)'} (BASE {BASE[name]})"
                )
        elif name in shared:
            version = shared[name]["version"]
            if version is None or not req.specifier.contains(version, prereleases=True):
                problems.append(
                    f"{who} requires {req.name}{req.specifier}; no release satisfies everyone "
                    f"({shared[name]['specifiers']})"
                )
    resolved = lock.get("resolved", {})
    if not resolved:
        problems.append("the lock records no pip resolution: run --refresh")
    for torch, chosen in resolved.items():
        if chosen.get("error"):
            problems.append(f"with {torch}: pip does not resolve the set: {chosen['error']}")
            continue
        for name, (version, _) in pins.items():
            if chosen.get(name) != version and name not in SOURCE_BUILT:
                problems.append(
                    f"with {torch}: pip resolved {name} {chosen.get(name)}, pin {version}"
                )
    return problems


def check_base() -> List[str]:
    """Inside the image: the installed torch and Transformer Engine lie inside BASE."""
    import importlib.metadata as md

    problems = []
    for name, spec in BASE.items():
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            problems.append(f"the base image has no {name} (need {name}{spec})")
            continue
        if not SpecifierSet(spec).contains(Version(version), prereleases=True):
            problems.append(
                f"the base image has {name} {version}, outside {spec}: pick another BASE_IMAGE"
            )
    return problems


# ---------------------------------------------------------------------------- refresh (network)
def _no_local_pip_config() -> Dict[str, str]:
    """The environment without PIP_* variables and with PIP_CONFIG_FILE=os.devnull, which
    makes pip skip every configuration file (a machine's global constraints or indexes
    included; ``--isolated`` alone still reads the global one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull}


def _pip(*args: str) -> str:
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args]
    env = _no_local_pip_config()
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
    out = _pip("index", "versions", "--python-version", PYTHON, name)
    m = re.search(r"Available versions: (.*)", out)
    versions = []
    for v in m.group(1).split(",") if m else []:
        try:
            versions.append(Version(v.strip()))
        except InvalidVersion:  # old releases with non-PEP 440 versions
            continue
    return sorted(versions, reverse=True)


def _resolve(lock: dict, pins: Pins, torch: str) -> Dict[str, str]:
    """``pip install --dry-run --report`` of the image's Python set with ``torch`` standing in
    for the base's (TE, the base's, and a requirement on a base package are left out):
    {distribution: version}, or {"error": pip's last line}. Run by Python 3.12 on Linux
    x86_64 (the image's platform; pip's own resolution with --platform / --only-binary
    refuses sdist-only releases the image's pip would build, so it is not used)."""
    import platform

    if sys.version_info[:2] != (3, 12) or platform.machine() != "x86_64":
        raise SystemExit(
            "--refresh resolves the set for the image: run it with Python 3.12 on x86_64"
        )
    lines = [f"torch=={torch}"]
    for who, req in _declared(lock, pins):
        name = canonicalize_name(req.name)
        if name in BASE or name in SOURCE_BUILT:
            continue
        req.marker = None  # _declared kept only what applies in the image
        lines.append(str(req))
    lines += [f"{n}=={v}" for n, (v, _) in pins.items() if n not in SOURCE_BUILT]
    with tempfile.TemporaryDirectory() as tmp:
        reqs, report = Path(tmp) / "requirements.txt", Path(tmp) / "report.json"
        reqs.write_text("\n".join(lines) + "\n")
        cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check"]
        cmd += ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
        env = _no_local_pip_config()
        r = subprocess.run(cmd + ["-r", str(reqs)], capture_output=True, text=True, env=env)
        if r.returncode:
            return {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:300]}
        installed = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installed}


def refresh(wheel_dir: Path, pins: Pins, resolve: bool = True) -> dict:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    requires = {
        name: _requires_dist(wheel_dir, name, version) for name, (version, _) in pins.items()
    }
    lock = {
        "note": "written by slurm/container_pins.py --refresh; read by its check "
        "(see its docstring)",
        "platform": {"python": PYTHON, "platforms": list(PLATFORMS)},
        "pins": {k: [v, list(e)] for k, v, e in ((k, *pins[k]) for k in sorted(pins))},
        "requires": requires,
        "source_built": SOURCE_BUILT,
        "not_read": NOT_READ,
        "base": {
            name: {
                "range": spec,
                "releases": sorted(
                    (str(v) for v in _index_versions(name) if SpecifierSet(spec).contains(v)),
                    key=Version,
                ),
            }
            for name, spec in BASE.items()
        },
        "shared": {},
        "resolved": {},
    }
    specs: Dict[str, Dict[str, str]] = {}
    for who, req in _declared(lock, pins):
        name = canonicalize_name(req.name)
        if name not in pins and name not in BASE:
            specs.setdefault(name, {})[who] = str(req.specifier)
    for name, by in sorted(specs.items()):
        if len(by) < 2:
            continue
        together = SpecifierSet(",".join(s for s in by.values() if s))
        version = next((str(v) for v in _index_versions(name) if together.contains(v)), None)
        lock["shared"][name] = {"version": version, "specifiers": by}
    if resolve:
        lock["platform"]["resolved_on"] = (
            f"CPython {sys.version.split()[0]}, {os.confstr('CS_GNU_LIBC_VERSION')}"
        )
        torches = lock["base"]["torch"]["releases"]
        for torch in sorted({torches[0], torches[-1]}, key=Version):
            lock["resolved"][f"torch=={torch}"] = _resolve(lock, pins, torch)
    return lock


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--refresh",
        metavar="DIR",
        help="re-read the wheels (downloaded into DIR), re-resolve and rewrite the lock",
    )
    p.add_argument(
        "--lock", default=str(LOCK), help="the lock file (default: slurm/container-lock.json)"
    )
    p.add_argument(
        "--check-base",
        action="store_true",
        help="inside the image: its torch and Transformer Engine lie inside BASE",
    )
    p.add_argument(
        "--requirements",
        default=str(REQUIREMENTS),
        help="the pins (default: slurm/container-requirements.txt)",
    )
    args = p.parse_args(argv)
    if args.check_base:
        problems = check_base()
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return 1 if problems else 0
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
            f"{len(pins)} pins and the base's {', '.join(BASE)} agree with "
            f"{sum(len(v) for v in lock['requires'].values())} declared requirements and "
            f"{len(lock['shared'])} shared dependencies; pip resolves the set with "
            f"{' and '.join(lock['resolved'])}"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
