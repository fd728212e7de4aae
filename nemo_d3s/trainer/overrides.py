"""Command-line override keys checked against the schema before Hydra sees them: a key off
:class:`nemo_d3s.config.TrainConfig` is one line naming the nearest key, exit code 2. Free
mappings (``model.params``), ``+``/``~`` keys, group selections and ``hydra.*`` go to Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import List, Optional, Sequence

__all__ = ["expand_home", "resume_deletions", "schema_keys", "unknown_key_error"]


def _fields(cls: type) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name) for f in dataclasses.fields(cls)}


def schema_keys(cls: Optional[type] = None, prefix: str = "") -> List[str]:
    """Every dotted key of the schema (a mapping field ends a key: its contents are free)."""
    from nemo_d3s.config import TrainConfig

    out = []
    for name, tp in _fields(cls or TrainConfig).items():
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += schema_keys(tp, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def _unknown(key: str, groups: Sequence[str]) -> bool:
    from nemo_d3s.config import TrainConfig

    cls: type = TrainConfig
    parts = key.split(".")
    if len(parts) == 1 and key in groups:
        return False
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields:
            return True
        tp = fields[part]
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            # a leaf: nothing may follow, unless it is a mapping (free keys) or Any
            origin = typing.get_origin(tp)
            free = tp is typing.Any or origin in (dict, typing.Dict) or tp is dict
            return i < len(parts) - 1 and not free
        cls = tp
    return False


def unknown_key_error(argv: Sequence[str], groups: Sequence[str]) -> Optional[str]:
    """The error line for the first override whose key is not in the schema, or None."""
    for a in argv:
        key, eq, _ = a.partition("=")
        if not eq or a.startswith("-") or key[:1] in "+~" or key.startswith("hydra."):
            continue
        if "/" in key or "@" in key or not key:
            continue
        if _unknown(key, groups):
            near = difflib.get_close_matches(key, schema_keys(), n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}?" if near else "see conf/ and nemo_d3s/config.py"
            return f"{key}: no such setting; {hint} (from the command line: {a!r})"
    return None


_HOME_PATH = re.compile(r"^~[\w.-]*(/|$)")


def expand_home(argv: Sequence[str]) -> List[str]:
    """``key=~/path`` with ``~`` expanded (quoted values too): the shell does not expand it after
    ``key=``, and Hydra's override grammar refuses a value starting with it."""
    out = []
    for a in argv:
        key, eq, value = a.partition("=")
        quote = value[:1] if len(value) > 1 and value[:1] in "'\"" and value[-1] == value[0] else ""
        inner = value[1:-1] if quote else value
        if eq and not a.startswith("-") and _HOME_PATH.match(inner):
            a = f"{key}={quote}{os.path.expanduser(inner)}{quote}"
        out.append(a)
    return out


def resume_deletions(argv: Sequence[str], groups: Sequence[str]) -> tuple:
    """(argv for Hydra, the ``~key`` deletions it must not see): under ``resume=true`` a deletion
    is of a key of the run's own config, which the composed default may lack (Hydra: "Could
    not delete from config"); the resumed config applies it (``run_start.resolve_config``)."""
    resume = any(
        a.partition("=")[0] == "resume" and a.partition("=")[2].lower() == "true" for a in argv
    )
    if not resume:
        return list(argv), []
    keep, held = [], []
    for a in argv:
        key = a.partition("=")[0]
        if a.startswith("~") and "=" not in a and key[1:] not in groups and "/" not in key:
            held.append(a)
        else:
            keep.append(a)
    return keep, held
