"""``resume=true``: a resumed run's config is the run's own (``decision.trusted_run_config``: the
newest checkpoint's run record, else ``config.yaml``) with the overrides the current command
line touches applied on top (:func:`touched_keys`), then the start's checks (``decision``). A
value outside the schema is a ConfigError naming file and key. Every rank computes this from
the same files; :func:`agree_on_config` checks they agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from contextlib import nullcontext as _nothing
from typing import Any, Callable, Iterable, List, Optional, Sequence, Set

from omegaconf import DictConfig, OmegaConf, open_dict

from nemo_d3s.errors import ConfigError
from nemo_d3s.trainer.faults import first_line
from nemo_d3s.trainer.run_start.config_file import diff_values, leaf_keys
from nemo_d3s.trainer.run_start.decision import trusted_run_config

__all__ = ["agree_on_config", "merge_untouched", "resolve_config", "touched_keys"]

log = logging.getLogger("nemo_d3s.train")

_ABSENT = object()
# Always the current command's: they say where and how this start runs.
_ALWAYS_TOUCHED = ("output_dir", "resume")


def _package_of(conf: Path, group: str, option: str) -> str:
    """The package an option of ``group`` writes to: ``_global_``, or a dotted path."""
    default = group.replace("/", ".")
    path = conf / group / f"{option}.yaml"
    if path.is_file():
        try:
            for line in path.read_text(encoding="utf-8").splitlines()[:5]:
                if line.startswith("# @package"):
                    pkg = line.split(None, 2)[2].strip() if len(line.split()) > 2 else ""
                    return default if pkg in ("", "_group_") else pkg
        except (OSError, UnicodeDecodeError, IndexError):
            return default
        return default
    from hydra.core.config_store import ConfigStore

    node = ConfigStore.instance().repo
    for part in group.split("/"):
        node = node.get(part, {}) if isinstance(node, dict) else {}
    found = node.get(f"{option}.yaml") if isinstance(node, dict) else None
    pkg = getattr(found, "package", None)
    return default if pkg in (None, "", "_group_") else pkg


def _is_group(conf: Path, name: str) -> bool:
    from hydra.core.config_store import ConfigStore

    node: Any = ConfigStore.instance().repo
    for part in name.split("/"):
        node = node.get(part) if isinstance(node, dict) else None
    return (conf / name).is_dir() or isinstance(node, dict)


def _global_option_keys(conf: Path, group: str, option: str) -> List[str]:
    """Leaves a ``_global_`` option file sets, and the packages its defaults override."""
    import yaml

    try:
        raw = yaml.safe_load((conf / group / f"{option}.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    if not isinstance(raw, dict):
        return []
    out = []
    for entry in raw.pop("defaults", None) or []:
        if isinstance(entry, dict):
            for k in entry:
                g = str(k).replace("override", "", 1).strip().lstrip("/")
                if g and g != "_self_":
                    out.append(g.replace("/", "."))
    return out + [k for k in leaf_keys(raw) if k]


def touched_keys(overrides: Sequence[str], conf: Path) -> Set[str]:
    """Dotted keys the ``overrides`` touch: ``key=value`` (and ``+``/``++``/``~``) and all under it;
    ``group=option`` with a package (``d3s=pods``): every leaf under that package; a
    ``_global_`` option (``experiment=smoke``): the keys its file sets and the groups its defaults
    override. :func:`resolve_config` adds leaves that differ from an empty command line's config.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = set(_ALWAYS_TOUCHED)
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        key = o.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if not _is_group(conf, key):
            out.add(key)
            continue
        value = o.value()
        if o.package is not None:
            out.add(o.package)
        elif isinstance(value, str) and _package_of(conf, key, value) == "_global_":
            out.update(_global_option_keys(conf, key, value))
        else:
            out.add(key.replace("/", "."))
    return out


def _covers(keys: Iterable[str], path: str) -> bool:
    return any(path == k or path.startswith(k + ".") for k in keys)


def _below(keys: Iterable[str], path: str) -> bool:
    return any(k.startswith(path + ".") for k in keys) if path else any(True for _ in keys)


def merge_untouched(old: Any, new: Any, touched: Set[str]) -> Any:
    """The effective config as a plain dict: ``new``'s value for touched leaves (absent
    where ``new`` lacks them), ``old``'s for the rest (absent where ``old`` lacks them)."""
    out = _merge(old, new, touched, "", True, True)
    return {} if out is _ABSENT else out


def _merge(o: Any, n: Any, touched: Set[str], path: str, o_has: bool, n_has: bool) -> Any:
    if path and _covers(touched, path):
        return n if n_has else _ABSENT
    o_d, n_d = o_has and isinstance(o, dict), n_has and isinstance(n, dict)
    if not _below(touched, path) or not (o_d or n_d):
        return o if o_has else _ABSENT
    od, nd = (o if o_d else {}), (n if n_d else {})
    out = {}
    for k in [*od, *(k for k in nd if k not in od)]:
        v = _merge(
            od.get(k), nd.get(k), touched, f"{path}.{k}" if path else str(k), k in od, k in nd
        )
        if v is not _ABSENT:
            out[k] = v
    return out if (o_has or out) else _ABSENT


def _apply(node: DictConfig, eff: dict, new: dict, fixed: Set[str], path: str, report) -> None:
    """Make ``node`` equal ``eff`` in plain form, never removing a schema key and adding a
    non-schema key only under a free mapping (``model.params``); the resume check lists others.
    """
    for k in list(new):
        key = f"{path}.{k}" if path else str(k)
        if k not in eff and not (key in fixed or _below(fixed, key)):
            with open_dict(node):
                del node[k]
    for k, e in eff.items():
        key = f"{path}.{k}" if path else str(k)
        n = new.get(k, _ABSENT)
        if isinstance(e, dict) and isinstance(n, dict) and isinstance(node.get(k), DictConfig):
            _apply(node[k], e, n, fixed, key, report)
        elif n is _ABSENT and not _covers(fixed, key):
            continue
        elif n is _ABSENT or e != n:
            try:
                with open_dict(node):
                    node[k] = e
            except Exception as exc:  # a value of the file that the schema refuses
                report(key, e, exc)


def resolve_config(
    cfg: DictConfig,
    overrides: Sequence[str],
    out: Path,
    compose_neutral: Callable[[], Any],
    conf: Path,
) -> DictConfig:
    """``cfg`` with every leaf the overrides do not touch taken from the run's own config;
    ``cfg`` itself when ``resume`` is false or ``out`` holds no run (no checkpoint, no readable
    ``config.yaml``). A ConfigError when it holds checkpoints and no config to trust.
    """
    from nemo_d3s.trainer.overrides import schema_keys

    if not bool(cfg.get("resume", False)):
        return cfg
    old, path = trusted_run_config(out)
    deletions = [o[1:] for o in overrides if o.startswith("~") and "=" not in o]
    if old is None:  # nothing to continue: a fresh start (the start says so), where the ~key
        # deletions held back from Hydra (train.main) are of the composed config's keys
        plain = OmegaConf.to_container(cfg, resolve=False)
        for d in deletions:
            if not _has_key(plain, d):
                raise ConfigError(f"~{d}: the config has no such key")
            _drop(cfg, d)
        return cfg
    new = OmegaConf.to_container(cfg, resolve=True)
    touched = touched_keys(overrides, conf)
    try:
        neutral = OmegaConf.to_container(compose_neutral(), resolve=True)
    except Exception as e:  # only the explicit rule then
        log.warning("resume=true: the default config cannot be composed (%s)", first_line(e))
        neutral = None
    if isinstance(neutral, dict):
        touched |= {k for k, _, _, _ in diff_values(neutral, new)}
    eff = merge_untouched(old, new, touched)
    allow = bool(cfg.trainer.allow_config_change)

    def report(key: str, value: Any, exc: Exception) -> None:
        what = f"{path}: {key}={value!r} does not fit the run's schema ({first_line(exc)})"
        if not allow:
            raise ConfigError(
                f"{what}; restore the file, or pass trainer.allow_config_change=true to "
                "resume with this command's value"
            )
        log.warning("%s; using this command's value (trainer.allow_config_change=true)", what)

    fixed = set(schema_keys())
    for d in deletions:
        if d in fixed or _below(fixed, d):
            raise ConfigError(f"~{d}: a setting of the run's schema cannot be deleted; set it")
        if not (_has_key(old, d) or _has_key(new, d)):
            raise ConfigError(f"~{d}: the run's config ({path}) has no such key")
        _drop(cfg, d)  # held back from Hydra (train.main): it may be the run's key alone
        _drop(new, d)
    _apply(cfg, eff, new, fixed, "", report)
    given = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in _ALWAYS_TOUCHED]
    log.info(
        "resume=true: the run's own config (%s) with this command's overrides: %s",
        path,
        " ".join(given) or "none",
    )
    return cfg


def _drop(node: Any, dotted: str) -> None:
    """Delete ``dotted`` from a dict or DictConfig when there."""
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.get(part) if isinstance(node, (dict, DictConfig)) else None
    if isinstance(node, (dict, DictConfig)) and last in node:
        with open_dict(node) if isinstance(node, DictConfig) else _nothing():
            del node[last]


def _has_key(d: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return False
        d = d[part]
    return True


def config_digest(cfg: Any) -> str:
    """SHA-256 of the resolved config as canonical JSON, without ``output_dir`` (a ``${now:...}``
    default may resolve a second apart on two ranks).
    """
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    plain = {k: v for k, v in plain.items() if k != "output_dir"}
    text = json.dumps(plain, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def agree_on_config(cfg: Any, gather: Optional[Callable[[str], List[Optional[str]]]]) -> None:
    """ConfigError on every rank naming the ranks whose :func:`config_digest` differs from rank 0's.
    ``gather``: all-gather of one text per rank (None for one process); 64 bytes per rank.
    """
    if gather is None:
        return
    digests = gather(config_digest(cfg))
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise ConfigError(
            f"rank(s) {', '.join(map(str, odd))} run another config than rank 0 (different "
            "command lines, or output_dir/config.yaml changed while the ranks started); "
            "start every rank with the same command"
        )
