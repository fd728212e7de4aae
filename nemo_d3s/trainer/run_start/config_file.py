"""The run's config on disk: ``config.yaml`` read, compared and written; what a fresh run
refuses, what ``resume=true`` without a checkpoint moves aside. Rank 0 runs these
(``faults.agree_on_main``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Tuple

from omegaconf import OmegaConf

from nemo_d3s.files import atomic_write_text
from nemo_d3s.errors import ConfigError
from nemo_d3s.trainer.faults import first_line
from nemo_d3s.trainer.run_start.folder import move_aside, records

__all__ = [
    "RESUME_SAFE",
    "compare_config",
    "diff_values",
    "leaf_keys",
    "move_records_aside",
    "read_run_config",
    "refuse_records",
    "resume_safe",
    "write_config",
]

log = logging.getLogger("nemo_d3s.trainer")

# Keys a resumed run may change without becoming a different experiment (resources,
# cadence, logging); any other change needs trainer.allow_config_change=true.
RESUME_SAFE = (
    "resume",
    "output_dir",
    "logging.",
    "trainer.steps",
    "trainer.eval_every",
    "trainer.eval_at_start",
    "trainer.eval_batch_size",
    "trainer.save_every",
    "trainer.keep_last",
    "trainer.export_hf",
    "trainer.micro_batch_size",
    "trainer.logprob_micro_batch_size",
    "trainer.micro_batch_tokens",
    "trainer.logprob_micro_batch_tokens",
    "trainer.allow_config_change",
    "trainer.max_failed_reward_steps",
    "trainer.dist_timeout_minutes",
    "trainer.reward_workers",
    "trainer.dry_run",
    "trainer.gpu_memory_gb",
    "task.max_eval_size",
    "model.device",
    "model.gradient_checkpointing",
    "rollout.gpu_memory_utilization",
    "rollout.sleep",
    "rollout.enforce_eager",
    "rollout.cpu_kv_cache_gb",
    "rollout.refit_bucket_mb",
    # The Megatron layout: checkpoints are resharded on load to any TP x PP (x VPP), with
    # either optimizer (docs/scaling.md; backends/megatron/checkpoint.py), so a resume at
    # another layout is the same experiment.
    "model.params.tensor_model_parallel_size",
    "model.params.pipeline_model_parallel_size",
    "model.params.virtual_pipeline_model_parallel_size",
    "model.params.sequence_parallel",
    "model.params.distributed_optimizer",
    "model.params.use_tp_pp_dp_mapping",
)


def resume_safe(key: str) -> bool:
    """May a resumed run change ``key`` (a dotted config key) and stay the same experiment?"""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_SAFE)


def read_run_config(out: Path) -> Tuple[Optional[dict], Optional[str]]:
    """``out/config.yaml`` (untrusted) as a resolved plain mapping: ``(mapping, None)``,
    ``(None, None)`` when absent, ``(None, why)`` when unreadable or not a mapping.
    """
    path = out / "config.yaml"
    if not path.is_file():
        return None, None
    try:
        old = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # OSError, YAML and interpolation errors alike
        return None, first_line(e)
    if not isinstance(old, dict):
        return None, f"not a mapping but {type(old).__name__}"
    return old, None


def refuse_records(out: Path, cfg: Any = None) -> None:
    """A fresh run never takes over another run's records, nor the folder of another
    experiment (its ``config.yaml`` would be replaced): ConfigError."""
    found = records(out)
    if found:
        raise ConfigError(
            f"output_dir={str(out)!r} holds an earlier run's records ({', '.join(found)}) "
            "and no checkpoint; choose another output_dir, or pass resume=true to move "
            "them into previous-<n>/ and start from step 0"
        )
    path = out / "config.yaml"
    if cfg is None:
        return
    old, why = read_run_config(out)
    if why is not None:
        raise ConfigError(
            f"{str(path)!r} cannot be read ({why}) and a fresh run would replace it; "
            "choose another output_dir, or remove the file"
        )
    if old is None:
        return
    new = OmegaConf.to_container(cfg, resolve=True)
    changed = [(k, a, b) for k, a, b, _ in diff_values(old, new) if not resume_safe(k)]
    if changed:
        listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:4])
        raise ConfigError(
            f"output_dir={str(out)!r} holds the config.yaml of another experiment ({listing}"
            f"{' ...' if len(changed) > 4 else ''}) that a fresh run would replace; choose "
            "another output_dir, or remove that config.yaml"
        )


def move_records_aside(out: Path) -> None:
    """``resume=true`` without a checkpoint: earlier records go to ``previous-<n>/``."""
    found = records(out)
    if found:
        dest = move_aside(out, found)
        log.warning(
            "resume=true found no checkpoint but an earlier run's %s; moved them to %s and "
            "starting from step 0",
            ", ".join(found),
            dest,
        )


def compare_config(cfg: Any, old: dict, where: str) -> None:
    """The resumed ``cfg`` must be the experiment ``old`` describes (read from ``where``): a
    ConfigError naming the changed keys, or with ``trainer.allow_config_change`` a warning (see
    ``RESUME_SAFE``). A file lacking schema keys counts as cut short, not as a change."""
    allow = bool(cfg.trainer.allow_config_change)
    new = OmegaConf.to_container(cfg, resolve=True)
    # Only keys every config has (the schema's) tell a cut-short file: keys under a free
    # mapping (task.params, model.params) come and go with the task or a "+" override, and
    # are a changed experiment, listed below.
    from nemo_d3s.trainer.overrides import schema_keys

    fixed = set(schema_keys())
    lacking = [k for k in leaf_keys(new) if k in fixed and not resume_safe(k) and not _has(old, k)]
    if lacking:
        what = (
            f"{where} lacks {len(lacking)} key(s) of the run's config "
            f"({', '.join(lacking[:4])}{' ...' if len(lacking) > 4 else ''}): emptied, cut "
            "short or written by another version"
        )
        if not allow:
            raise ConfigError(
                f"{what}, so a changed setting would pass unseen; restore it, or pass "
                "trainer.allow_config_change=true to resume without the check"
            )
        log.warning("%s; continuing (trainer.allow_config_change=true)", what)
    diffs = [
        (k, a if had else "<absent>", b)
        for k, a, b, had in diff_values(old, new)
        if had or k not in fixed
    ]
    changed = [(k, a, b) for k, a, b in diffs if not resume_safe(k)]
    listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:8]) + (
        " ..." if len(changed) > 8 else ""
    )
    if changed and not allow:
        raise ConfigError(
            f"resume=true with a config that changes the experiment ({listing}); resume "
            f"with the original values (see {where}), or pass "
            "trainer.allow_config_change=true to continue anyway"
        )
    if changed:
        log.warning(
            "resuming with a changed experiment (trainer.allow_config_change=true): %s", listing
        )
    if any(k == "trainer.steps" for k, _, _ in diffs):
        log.warning(
            "trainer.steps changed on resume: the (N, K) and LR schedules are functions of "
            "it, so the steps from here on differ from a run started with the new value"
        )


def write_config(cfg: Any, out: Path, *, resumed: bool) -> None:
    """DIR/config.yaml; a resumed run keeps it and writes a differing config (allowed keys, or
    ``trainer.allow_config_change``) to ``config.resumed-<n>.yaml``.
    """
    path = out / "config.yaml"
    new = OmegaConf.to_container(cfg, resolve=True)
    text = OmegaConf.to_yaml(OmegaConf.create(new))
    if resumed and path.is_file():
        try:
            same = OmegaConf.to_container(OmegaConf.load(path), resolve=True) == new
        except Exception:
            same = False
        if same:
            return
        n = 1
        while (out / f"config.resumed-{n}.yaml").exists():
            n += 1
        atomic_write_text(out / f"config.resumed-{n}.yaml", text)
        log.info(
            "kept the original config.yaml; this segment's config is config.resumed-%d.yaml", n
        )
        return
    atomic_write_text(path, text)


def diff_values(a: Any, b: Any, prefix: str = "", had: bool = True) -> list:
    """(dotted key, old, new, the old config had the key) for every differing leaf."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += diff_values(a.get(k), b.get(k), f"{prefix}{k}.", had and k in a)
        return out
    return [] if a == b else [(prefix.rstrip("."), a, b, had)]


def leaf_keys(d: Any, prefix: str = "") -> list:
    """Dotted keys of every leaf of a nested dict (an empty dict is a leaf)."""
    if isinstance(d, dict) and d:
        return [k for key in d for k in leaf_keys(d[key], f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def _has(d: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return False
        d = d[part]
    return True
