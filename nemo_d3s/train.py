"""``python -m nemo_d3s.train`` / ``nemo-d3s-train``: the Hydra entry point of training.

    python -m nemo_d3s.train                                  # SmolLM2-135M, D3S, CPU
    python -m nemo_d3s.train experiment=smoke d3s=d1s trainer.steps=50
    python -m nemo_d3s.train output_dir=/tmp/smoke resume=true trainer.steps=8  # continue it
    torchrun --nproc_per_node=2 -m nemo_d3s.train experiment=smoke output_dir=/tmp/dp2

The config is ``<repo>/conf`` (``$NEMO_D3S_CONF_DIR`` overrides it; ``nemo_d3s/conf`` for a
wheel). Output goes to ``output_dir`` (Hydra does not chdir); a sweep that does not set it
writes each job to Hydra's job folder.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

__all__ = ["EXIT_INTERRUPTED", "main", "compose_config", "conf_dir", "run_cli"]

log = logging.getLogger("nemo_d3s.train")

# A run stopped by a signal (SIGTERM, SIGUSR1, a first Ctrl-C) after writing its checkpoint:
# not finished, so `train && convert` does not go on; resume=true continues it. 75 is
# EX_TEMPFAIL of sysexits.h ("try again later"). The sbatch scripts requeue on it (through
# torchrun, which reports any non-zero worker as 1, they read DIR/interrupted.json instead).
EXIT_INTERRUPTED = 75


def conf_dir() -> Path:
    """The Hydra config folder: $NEMO_D3S_CONF_DIR, <repo>/conf, or <package>/conf."""
    env = os.environ.get("NEMO_D3S_CONF_DIR")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here.parent / "conf", here / "conf"]
    for c in candidates:
        if (c / "config.yaml").is_file():
            return c
    raise FileNotFoundError(
        "cannot find the Hydra config folder (conf/config.yaml); looked in "
        + ", ".join(str(c) for c in candidates)
        + ". Install from a source checkout (pip install -e .) or set NEMO_D3S_CONF_DIR."
    )


def compose_config(overrides=()):
    """The config ``python -m nemo_d3s.train <overrides>`` would run, as a DictConfig, without
    Hydra's run directory or logging set-up (for scripts, notebooks and tests)."""
    from hydra import compose, initialize_config_dir

    from nemo_d3s.config import register_configs

    register_configs()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _job_output_dir(cfg) -> str:
    """``output_dir``, except in a sweep that does not set it: then Hydra's job folder."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hc = HydraConfig.get()
    except ValueError:
        return str(cfg.output_dir)
    user_set = any(o.split("=", 1)[0].lstrip("+~") == "output_dir" for o in hc.overrides.task)
    if hc.mode == RunMode.MULTIRUN and not user_set:
        return str(hc.runtime.output_dir)
    return str(cfg.output_dir)


# errno values that mean "the machine or the path", not a bug: reported as one error line.
_ENV_ERRNOS = {
    "ENOSPC",
    "EDQUOT",
    "EROFS",
    "EACCES",
    "EPERM",
    "ENOTDIR",
    "EISDIR",
    "EEXIST",
    "ENAMETOOLONG",
    "EFBIG",
}


def _is_collective_timeout(e: BaseException) -> bool:
    from nemo_d3s.distributed.generation_wait import GenerationTimeout

    if isinstance(e, GenerationTimeout):  # the wait for the others' generations
        return True
    msg = str(e).lower()
    return ("timed out" in msg or "timeout" in msg) and any(
        w in msg
        for w in (
            "gloo",
            "nccl",
            "collective",
            "recv",
            "send",
            "barrier",
            "allreduce",
            "all_reduce",
        )
    )


def run_cli(cfg) -> int:
    """Train on a resolved config; a user-facing fault is one ``error:`` line and exit 2 (bad input,
    run directory, disk) or 3 (a peer rank stopped answering). 0 when the run finished,
    :data:`EXIT_INTERRUPTED` (75) when a stop signal ended it at a checkpoint.
    """
    import errno

    from nemo_d3s.errors import ConfigError
    from nemo_d3s.trainer.faults import RunError, first_line
    from nemo_d3s.trainer.loop import train

    try:
        if getattr(
            cfg.trainer, "dry_run", False
        ):  # plan the layout instead of training: 0 fits, 1 does not
            from nemo_d3s.dry_run import dry_run

            return dry_run(cfg)
        state = train(cfg)
    except (ConfigError, RunError, FileNotFoundError) as e:
        # A user mistake or a fault of the surroundings, not a bug: one clear line, no traceback.
        print(f"error: {first_line(e) if isinstance(e, FileNotFoundError) else e}", file=sys.stderr)
        return 2
    except OSError as e:
        if errno.errorcode.get(e.errno or -1) not in _ENV_ERRNOS:
            raise
        where = f" ({e.filename})" if e.filename else ""
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            from nemo_d3s.trainer.checkpoint import space_note

            where += f"; {space_note(os.path.dirname(str(e.filename or cfg.output_dir)) or '.')}"
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if not _is_collective_timeout(e):
            raise
        t = getattr(getattr(cfg, "trainer", None), "dist_timeout_minutes", None)
        print(
            f"error: a collective timed out after {t} minutes "
            "(trainer.dist_timeout_minutes): another rank is stopped, dead or far behind; "
            f"resume=true continues from the last checkpoint ({first_line(e)})",
            file=sys.stderr,
        )
        return 3
    if state.extra.get("interrupted"):
        print(
            f"stopped at step {state.step} of {cfg.trainer.steps} (exit code "
            f"{EXIT_INTERRUPTED}: interrupted); continue with resume=true",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return 0


def _after_stop(signum, _frame) -> None:
    """The CLI's stop-signal handler once the loop's own are gone (``StartupStops`` hands it
    those the process was not started ignoring): ignored once a run has stopped at a
    checkpoint on a signal (while it prints its last lines and exits 75); before that,
    Python's default.
    """
    import signal

    from nemo_d3s.trainer.signals import STOPPING

    if STOPPING:
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


# ~key deletions held back from Hydra under resume=true (main), applied to the run's config.
_HELD: list = []


def _resume_base(cfg, out: Path):
    """``resume=true``: the run's own config with this command line's overrides on top
    (``trainer.run_start.resolve_config``); a refusal is one error line, exit 2.
    """
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    from nemo_d3s.errors import ConfigError
    from nemo_d3s.trainer.run_start import resolve_config

    try:
        overrides = list(HydraConfig.get().overrides.task) + _HELD
    except ValueError:  # not under hydra.main
        overrides = []
    try:
        return resolve_config(
            cfg, overrides, out, lambda: compose("config", overrides=[]), conf_dir()
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _catch_stops() -> None:
    """A stop signal before the loop's handlers (a start-up of many minutes) is recorded and
    carried over to them (``trainer.signals.StartupStops``); the loop installs its own over
    this one, then restores it."""
    from nemo_d3s.trainer.signals import StartupStops

    StartupStops.arm(_after_stop)


def _run(cfg) -> None:
    from omegaconf import OmegaConf, open_dict

    _catch_stops()  # (already by main; again for callers of _run)
    out = _job_output_dir(cfg)
    with open_dict(cfg):
        cfg.output_dir = out
    OmegaConf.resolve(cfg)
    cfg = _resume_base(cfg, Path(out))
    code = run_cli(cfg)
    if code:
        sys.exit(code)


def _precheck_argv(argv) -> None:
    """Check an ``output_dir=`` given on the command line before Hydra creates it, so a bad one is
    one error line and nothing is written.
    """
    from nemo_d3s.errors import ConfigError
    from nemo_d3s.trainer.faults import RunError
    from nemo_d3s.trainer.run_start import check_output_dir

    if any(
        a in ("-m", "--multirun") or a.startswith(("--cfg", "-c", "--help", "-h", "--info"))
        for a in argv
    ):
        return
    for a in argv:
        key, eq, value = a.partition("=")
        if eq and key.lstrip("+~") == "output_dir" and "${" not in value:
            try:
                check_output_dir(value.strip("'\""), create=False)
            except (ConfigError, RunError) as e:
                print(f"error: {e}", file=sys.stderr)
                sys.exit(2)


def main() -> None:
    _catch_stops()  # first: the imports and Hydra's composition take seconds
    import hydra

    from nemo_d3s.config import register_configs

    register_configs()
    from nemo_d3s.trainer.overrides import expand_home, resume_deletions, unknown_key_error

    sys.argv[1:] = expand_home(sys.argv[1:])  # model.name=~/models/x: as the user means it
    _precheck_argv(sys.argv[1:])

    groups = [p.name for p in conf_dir().iterdir() if p.is_dir()]
    sys.argv[1:], _HELD[:] = resume_deletions(sys.argv[1:], groups)  # the run's keys, not Hydra's
    bad = unknown_key_error(sys.argv[1:], groups)
    if bad:  # Hydra's answer is "+key" advice and exit 1
        print(f"error: {bad}", file=sys.stderr)
        sys.exit(2)
    # hydra.main parses sys.argv itself (--cfg job, -m, overrides).
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_run)()


if __name__ == "__main__":
    main()
