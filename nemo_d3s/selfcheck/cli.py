"""``nemo-d3s-selfcheck`` / ``python -m nemo_d3s.selfcheck``: run every check, print the
table, write ``--out/selfcheck.json``, exit 1 when a check failed.

Under torchrun / srun it joins that world (NCCL on CUDA, gloo on CPU); one process without
CUDA spawns ``--ranks`` gloo ranks; one process with CUDA is a one-rank world (multi-rank
checks not run). ``--out`` must be on a file system every rank sees.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["all_checks", "main", "run_rank"]


def all_checks():
    from nemo_d3s.selfcheck import (
        cluster_checks,
        comm_checks,
        env_checks,
        gpu_checks,
        model_checks,
        moe_checks,
        pipeline_checks,
        refit_checks,
        rl_checks,
        vllm_checks,
        vllm_moe_checks,
        vllm_routing_checks,
        vllm_stop_checks,
    )

    return [
        *env_checks.CHECKS,
        *cluster_checks.CHECKS,
        *comm_checks.CHECKS,
        *model_checks.CHECKS,
        *moe_checks.CHECKS,
        *pipeline_checks.CHECKS,
        *rl_checks.CHECKS,
        *refit_checks.CHECKS,
        *gpu_checks.CHECKS,
        *vllm_checks.CHECKS,
        *vllm_moe_checks.CHECKS,
        *vllm_routing_checks.CHECKS,
        *vllm_stop_checks.CHECKS,
    ]


def _selected(patterns: Optional[str]):
    checks = all_checks()
    if not patterns:
        return checks
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [
        c for c in checks if any(fnmatch.fnmatch(c.name, p) or c.name.startswith(p) for p in pats)
    ]


def run_rank(rank: int, opts: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every selected check on this rank of an existing process group (or none: one
    process); the records as plain dicts. Collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    from nemo_d3s.selfcheck.base import Context, build_tiny_model
    from nemo_d3s.selfcheck.report import run_check

    warnings.filterwarnings("ignore")  # megatron-core's import-time notices are not results
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available() and not opts.get("cpu")
    work = Path(opts["out"]) / ".selfcheck_work"
    ctx = Context(
        rank=rank,
        world=world,
        local_rank=local_rank,
        cuda=cuda,
        device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
        model_dir=Path(opts["model"]) if opts.get("model") else work / "tiny_model",
        tiny=not opts.get("model"),
        work_dir=work,
    )
    if rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        if ctx.tiny:
            build_tiny_model(ctx.model_dir)
    ctx.barrier()
    records = []
    progress = work / f"progress.rank{rank}.jsonl"  # read back when the run is cut short
    for check in _selected(opts.get("only")):
        r = run_check(
            check.name,
            check.needs_cuda,
            lambda c=check: c.fn(ctx),
            cuda=cuda,
            rank=rank,
            what=check.what,
        )
        records.append(asdict(r))
        with open(progress, "a", encoding="utf-8") as f:
            f.write(json.dumps(records[-1]) + "\n")
        gc.collect()  # the check's models are gone: give their memory back before the next one
        if cuda:
            torch.cuda.empty_cache()
    ctx.barrier()
    if rank == 0 and not opts.get("keep_work"):
        shutil.rmtree(work, ignore_errors=True)
    return records


def _spawned_rank(rank: int, opts: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A rank started by ``run_on_gloo_ranks`` (the process group exists)."""
    world = str(opts["ranks"])
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world
    )
    return run_rank(rank, opts)


def _join_world(opts: Dict[str, Any]) -> List[List[Dict[str, Any]]]:
    """Under torchrun / srun: join, run, gather every rank's records (all ranks get them)."""
    import torch
    import torch.distributed as dist

    from nemo_d3s.backends.megatron.parallel import set_cuda_connections

    cuda = torch.cuda.is_available() and not opts.get("cpu")
    if not dist.is_initialized():
        if cuda:
            set_cuda_connections()  # before CUDA initialises
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group(
                "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=opts["timeout"])
            )
        except dist.DistStoreError as e:  # a rank of a world whose peers never came
            world = os.environ.get("WORLD_SIZE")
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise _NoPeers(
                f"rank {os.environ.get('RANK')} of WORLD_SIZE={world} found no peer at {where} "
                f"within {opts['timeout']:g} s (--timeout; {str(e).splitlines()[0]}): a torchrun "
                "environment left set in this shell? unset WORLD_SIZE, RANK, MASTER_ADDR and "
                "MASTER_PORT to check this machine alone, or start every rank"
            ) from None
    try:
        mine = run_rank(dist.get_rank(), opts)
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone
    finally:
        dist.destroy_process_group()


def _one_process(opts: Dict[str, Any]) -> List[List[Dict[str, Any]]]:
    """One rank in a private one-member process group (in-memory store)."""
    import torch
    import torch.distributed as dist

    from nemo_d3s.backends.megatron.parallel import set_cuda_connections

    cuda = torch.cuda.is_available() and not opts.get("cpu")
    if cuda:
        set_cuda_connections()
        torch.cuda.set_device(0)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # what the trainer's set-up reads
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    try:
        return [run_rank(0, opts)]
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nemo-d3s-selfcheck",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", default="selfcheck", help="folder for selfcheck.json (default: ./selfcheck)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face folder to check with (default: a tiny random Llama)",
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated check names, prefixes or globs (e.g. env,gpt.*)",
    )
    p.add_argument(
        "--ranks", type=int, default=2, help="gloo ranks to spawn on a CPU-only machine (default 2)"
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=900.0,
        help="seconds for the spawned run / a collective (> 0)",
    )
    p.add_argument("--cpu", action="store_true", help="the CPU form even where CUDA is available")
    p.add_argument(
        "--keep-work", action="store_true", help="keep the scratch folder (checkpoints, runs)"
    )
    return p


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every bad argument or surrounding as one argparse error (exit 2), before any rank starts."""
    if args.ranks < 1:
        p.error("--ranks must be >= 1")
    if args.only is not None:
        pats = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [x for x in pats if not _selected(x)] or ([] if pats else [args.only])
        if unknown:  # "0 passed" with no check run read as a clean machine
            p.error(
                f"--only {args.only!r}: {', '.join(map(repr, unknown))} matches no check; the "
                f"checks are {', '.join(c.name for c in all_checks())}"
            )
    if args.model:
        cfg = Path(args.model, "config.json")
        if not cfg.is_file():
            p.error(
                f"--model {args.model!r}: no config.json there (a Hugging Face folder is expected)"
            )
        try:
            raw = json.loads(cfg.read_text(encoding="utf-8"))
            ok = isinstance(raw, dict) and ("model_type" in raw or "architectures" in raw)
            why = "names no model_type or architectures"
        except (OSError, UnicodeDecodeError, ValueError) as e:
            ok, why = False, f"is not JSON ({str(e).splitlines()[0]})"
        if not ok:
            p.error(
                f"--model {args.model!r}: {cfg} {why}: not a Hugging Face config (the model "
                "folder, not this machine, is at fault)"
            )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {args.out!r} is a file; name a folder (it gets selfcheck.json)")
    if (out / "selfcheck.json").exists() and not (out / "selfcheck.json").is_file():
        p.error(
            f"--out {args.out!r}: {str(out / 'selfcheck.json')!r} is a folder, where the "
            "self-check writes its results; remove it or choose another --out"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        p.error(f"--out {args.out!r} is not writable: {e.strerror or e}")
    if "WORLD_SIZE" in os.environ:
        lacking = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if lacking:
            p.error(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {', '.join(lacking)} not (not "
                "started by torchrun?); unset WORLD_SIZE to run here, or start it with torchrun"
            )


class _NoPeers(Exception):
    """The torchrun environment names a world whose other ranks never joined."""


class _Stopped(BaseException):
    """SIGTERM in the parent process (KeyboardInterrupt stands for SIGINT)."""


def _on_sigterm(_signum, _frame):
    raise _Stopped()


def _partial(work: Path, names: List[str], why: str) -> List[List[Dict[str, Any]]]:
    """What the ranks finished before the run was cut short (their progress files), padded
    with "not run" records saying why for the rest; [] when no rank finished a check."""
    per_rank = []
    for f in sorted(work.glob("progress.rank*.jsonl"), key=lambda f: int(f.stem[13:])):
        rows = []
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # the line being written when the rank was killed
                break
        per_rank.append(rows)
    done = min((len(r) for r in per_rank), default=0)
    by_name = {c.name: c for c in all_checks()}
    rest = [
        {"name": n, "needs_cuda": by_name[n].needs_cuda, "status": "not run", "reason": why}
        for n in names[done:]
    ]
    return [rows[:done] + rest for rows in per_rank] or [rest]


def _context(opts: Dict[str, Any], world: int, mode: str) -> Dict[str, Any]:
    import torch

    return {
        "argv": sys.argv[1:],
        "world": world,
        "mode": mode,
        "cuda": torch.cuda.is_available() and not opts["cpu"],
        "model": opts.get("model") or "tiny random Llama (built)",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the self-check (``nemo-d3s-selfcheck``); the exit code of its verdict."""
    from nemo_d3s.selfcheck.report import (
        CheckResult,
        combine,
        exit_code,
        finalize,
        format_table,
        write_json,
    )

    parser = _parser()
    args = parser.parse_args(argv)
    _check_arguments(parser, args)
    opts = {
        "out": str(Path(args.out).resolve()),
        "model": str(Path(args.model).resolve()) if args.model else None,
        "only": args.only,
        "ranks": args.ranks,
        "timeout": args.timeout,
        "cpu": args.cpu,
        "keep_work": args.keep_work,
    }
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    work = Path(opts["out"]) / ".selfcheck_work"
    rank, cut, code = int(os.environ.get("RANK", "0")), None, 0
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        if "WORLD_SIZE" in os.environ:
            mode, per_rank = "torchrun", _join_world(opts)
        elif not cuda and args.ranks > 1:
            from nemo_d3s.distributed.launch import run_on_gloo_ranks

            mode = f"spawned {args.ranks} gloo ranks"
            per_rank = run_on_gloo_ranks(_spawned_rank, args.ranks, opts, timeout=args.timeout)
        else:
            mode, per_rank = "one process", _one_process(opts)
    except _NoPeers as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TimeoutError:
        cut, code = f"the self-check ran out of time (--timeout {args.timeout:g} s)", 1
    except KeyboardInterrupt:
        cut, code = "the self-check was interrupted (SIGINT)", 128 + signal.SIGINT
    except _Stopped:
        cut, code = "the self-check was interrupted (SIGTERM)", 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if cut is not None:  # what finished, then the rest as not run; nothing left behind
        names = [c.name for c in _selected(opts["only"])]
        mode, per_rank = f"cut short: {cut}", _partial(work, names, cut)
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    results = finalize(
        combine([[CheckResult(**r) for r in records] for records in per_rank]), cuda=cuda
    )
    if rank == 0:
        print(format_table(results), flush=True)
        path = write_json(results, opts["out"], _context(opts, len(per_rank), mode))
        print(f"wrote {path}", flush=True)
    if cut is not None:
        print(f"error: {cut}; selfcheck.json holds the checks that finished", file=sys.stderr)
        return code
    return exit_code(results)


def console_main() -> None:
    """The console script: ``sys.exit(main())``."""
    sys.exit(main())
