"""``nemo-d3s-convert`` (also ``python -m nemo_d3s.convert``): HF <-> Megatron checkpoints.

Exit codes: 0 done (verify: the logits match), 1 an error (one line on stderr naming the
file or tensor) or, for verify, a mismatch, 2 a usage error.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import List, Optional

from nemo_d3s.backends.hf.gguf_convert import DEFAULT_MODEL_NAME
from nemo_d3s.convert.core import DEFAULT_SHARD_BYTES, DTYPES

_EPILOG = {
    "hf-to-megatron": """example:
  nemo-d3s-convert hf-to-megatron --hf ./Qwen2.5-7B-Instruct --out ./qwen7b-tp4 --tp 4 --pp 1
  # then train from it: model.backend=megatron model.name=./qwen7b-tp4 (any TP x PP)""",
    "megatron-to-hf": """examples:
  nemo-d3s-convert megatron-to-hf --ckpt runs/qwen/checkpoints/step_000200 \\
      --out ./qwen7b-d3s --dtype bfloat16
  # (a checkpoint written before checkpoints kept config.json + tokenizer:
  #  add --hf-config ./Qwen2.5-7B-Instruct)
  nemo-d3s-convert megatron-to-hf --ckpt ./qwen7b-tp4 --out ./qwen7b-back
  # a Megatron-LM / Megatron-Bridge save folder (or one iter_XXXXXXX/ of it); Megatron-LM
  # keeps no tokenizer: add --hf-config ./Qwen3-8B (its config.json then describes the model)
  nemo-d3s-convert megatron-to-hf --ckpt ./bridge_run/checkpoints --out ./qwen3-8b-rl""",
    "hf-to-megatron-lm": """example:
  nemo-d3s-convert hf-to-megatron-lm --hf ./Qwen3-32B --out ./qwen3-32b-mcore --tp 8
  # Megatron-LM: --load ./qwen3-32b-mcore --use-checkpoint-args (TP 8: the vocabulary
  # padding); Megatron-Bridge: checkpoint.pretrained_checkpoint=./qwen3-32b-mcore;
  # here: model.name=./qwen3-32b-mcore""",
    "megatron-to-nemo": """example:
  nemo-d3s-convert megatron-to-nemo --ckpt runs/qwen/checkpoints/step_000200 \\
      --hf-config ./qwen-sft-hf --nemo-context ./qwen-sft-nemo --out ./qwen-d3s-nemo
  # --nemo-context: the NeMo 2 checkpoint the run started from (its context/ is copied)""",
    "verify": """example:
  nemo-d3s-convert verify --hf ./qwen7b-d3s --ckpt runs/qwen/checkpoints/step_000200
  # prints OK/MISMATCH with the max abs logit error; exit code 0 when it matches""",
}


def _size(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
    }
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    try:
        return int(float(num) * units[t[len(num) :]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GiB or 500MB") from None


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a tolerance >= 0 (a negative one fails every logit)"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="nemo-d3s-convert",
        description=(
            "Convert checkpoints between Hugging Face folders and the Megatron backend's "
            "sharded checkpoints (the weight table of nemo_d3s.formats.weights). Output is "
            "written to a temporary sibling folder and renamed into place at the end."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(f"{k}: {v}" for k, v in _EPILOG.items()),
    )
    sub = ap.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=_EPILOG[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    p = add(
        "hf-to-megatron",
        "a Hugging Face folder (or a NeMo 2 checkpoint) -> a Megatron checkpoint folder "
        "(config.json, tokenizer, megatron/ shards; no optimizer state) that model.name can "
        "point at",
    )
    p.add_argument(
        "--hf",
        required=True,
        help="Hugging Face model folder (safetensors), a NeMo 2 checkpoint "
        f"(weights/ + context/), or {DEFAULT_MODEL_NAME}",
    )
    p.add_argument(
        "--out", required=True, help="output folder (must be empty or absent unless --overwrite)"
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel size of the shards (default 1)"
    )
    p.add_argument(
        "--pp", type=int, default=1, help="pipeline-parallel size of the shards (default 1)"
    )
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size of the expert shards (default 1)"
    )
    p.add_argument(
        "--etp",
        type=int,
        default=None,
        help="expert tensor-parallel size of the expert shards (default: --tp)",
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: keep)"
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="vocabulary padding, as model.params.make_vocab_size_divisible_by (default 128)",
    )

    p = add(
        "megatron-to-hf",
        "a Megatron checkpoint (training step_XXXXXX folder or converted, any TP x PP), a "
        "NeMo 2 checkpoint or a Megatron-LM / Megatron-Bridge one -> a Hugging Face folder that "
        "transformers loads",
    )
    p.add_argument(
        "--ckpt",
        required=True,
        help="checkpoint folder (or its megatron/ subfolder), a NeMo 2 checkpoint, or a "
        "Megatron-LM / Megatron-Bridge save folder (or one iter_XXXXXXX/)",
    )
    p.add_argument(
        "--out", required=True, help="output folder (must be empty or absent unless --overwrite)"
    )
    p.add_argument(
        "--hf-config",
        default=None,
        help=(
            "folder with config.json + tokenizer files (the model the run started from); "
            "needed for a training checkpoint written before checkpoints kept their model's "
            "config and tokenizer, and for a Megatron-LM checkpoint (no tokenizer; no "
            "vocab_size unless run with --vocab-size); its config.json then describes the model"
        ),
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="dtype written (default: as stored)"
    )
    p.add_argument(
        "--max-shard-size",
        type=_size,
        default=DEFAULT_SHARD_BYTES,
        help="largest safetensors file (default 5GiB)",
    )

    p = add(
        "hf-to-megatron-lm",
        "a Hugging Face folder (or any checkpoint read here) -> a Megatron-LM / Megatron-Bridge / "
        "NeMo-RL save folder (megatron-core dist_checkpointing, torch_dist: "
        "latest_checkpointed_iteration.txt + release/ with Megatron-LM args, run_config.yaml, "
        "tokenizer/)",
    )
    p.add_argument("--hf", required=True, help="Hugging Face model folder, or a checkpoint")
    p.add_argument(
        "--out", required=True, help="output folder (must be empty or absent unless --overwrite)"
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="TP size of the run that loads it: the vocabulary is padded to a multiple of "
        "--make-vocab-size-divisible-by x TP, as Megatron-LM / Megatron-Bridge compute it "
        "(default 1)",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="the loading run's make_vocab_size_divisible_by (default 128)",
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: keep)"
    )
    p.add_argument(
        "--hf-config", default=None, help="config.json + tokenizer folder for a checkpoint source"
    )

    p = add(
        "megatron-to-nemo",
        "a Megatron checkpoint (any TP x PP) -> a NeMo 2 checkpoint (weights/ written with "
        "megatron-core's dist_checkpointing under NeMo's names, context/ copied)",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint folder (or its megatron/ subfolder)")
    p.add_argument(
        "--out", required=True, help="output folder (must be empty or absent unless --overwrite)"
    )
    p.add_argument(
        "--nemo-context",
        required=True,
        help="a NeMo 2 checkpoint of the same model (e.g. the run's start); its context/ is copied",
    )
    p.add_argument("--hf-config", default=None, help="config.json folder for a training checkpoint")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="dtype written (default: the context's params_dtype)",
    )

    p = add(
        "verify",
        "compare logits of a few fixed prompts: transformers on --hf vs the checkpoint "
        "converted in memory; exit code 0 when they match",
    )
    p.add_argument("--hf", required=True, help="Hugging Face model folder")
    p.add_argument("--ckpt", required=True, help="Megatron or NeMo 2 checkpoint folder")
    p.add_argument(
        "--hf-config",
        default=None,
        help="config.json folder for a training checkpoint (default: the checkpoint's own "
        "config.json, else --hf)",
    )
    p.add_argument(
        "--atol",
        type=_tolerance,
        default=1e-4,
        help="largest accepted abs logit error (default 1e-4)",
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype (default float32)"
    )

    for p in sub.choices.values():
        p.add_argument(
            "--no-verify-checksums",
            dest="verify_checksums",
            action="store_false",
            help=(
                "use a checkpoint whose files do not match its checksums.json (training and "
                "converted checkpoints carry one; it is checked by default, reading every file "
                "once)"
            ),
        )
        if p.prog.endswith("verify"):
            continue
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (a scheduler's kill) unwinds like Ctrl-C: the temporary output is removed.
    previous = (
        signal.signal(signal.SIGTERM, _terminate)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    try:
        return _run(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise KeyboardInterrupt


def _run(args: argparse.Namespace) -> int:
    from nemo_d3s.errors import ConfigError, RunError
    from nemo_d3s.convert import core, verify_logits
    from nemo_d3s.versions import check_stack

    try:
        # torch reads and writes every format; megatron-core writes NeMo 2 and Megatron-LM's
        # torch_dist (its dist_checkpointing)
        mcore = args.command in ("megatron-to-nemo", "hf-to-megatron-lm")
        check_stack(["torch"] + (["megatron-core"] if mcore else []))
        if args.command == "hf-to-megatron":
            out = core.hf_to_megatron(
                args.hf,
                args.out,
                tp=args.tp,
                pp=args.pp,
                ep=args.ep,
                etp=args.etp,
                dtype=args.dtype,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                overwrite=args.overwrite,
                progress=not args.quiet,
                verify_checksums=args.verify_checksums,
            )
            print(f"wrote {out} (TP{args.tp} x PP{args.pp} x EP{args.ep})")
        elif args.command == "megatron-to-hf":
            out = core.megatron_to_hf(
                args.ckpt,
                args.out,
                hf_config=args.hf_config,
                dtype=args.dtype,
                max_shard_bytes=args.max_shard_size,
                overwrite=args.overwrite,
                progress=not args.quiet,
                verify_checksums=args.verify_checksums,
            )
            print(f"wrote {out}")
        elif args.command == "hf-to-megatron-lm":
            from nemo_d3s.convert.mcore import hf_to_megatron_lm

            out = hf_to_megatron_lm(
                args.hf,
                args.out,
                tp=args.tp,
                dtype=args.dtype,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                hf_config=args.hf_config,
                overwrite=args.overwrite,
                progress=not args.quiet,
                verify_checksums=args.verify_checksums,
            )
            print(f"wrote {out} (Megatron-LM / Megatron-Bridge torch_dist, release/)")
        elif args.command == "megatron-to-nemo":
            out = core.megatron_to_nemo(
                args.ckpt,
                args.out,
                nemo_context=args.nemo_context,
                hf_config=args.hf_config,
                dtype=args.dtype,
                overwrite=args.overwrite,
                progress=not args.quiet,
                verify_checksums=args.verify_checksums,
            )
            print(f"wrote {out}")
        else:
            res = verify_logits.verify(
                args.hf,
                args.ckpt,
                hf_config=args.hf_config,
                atol=args.atol,
                dtype=args.dtype,
                verify_checksums=args.verify_checksums,
            )
            print(res.verdict())
            return 0 if res.ok else 1
    except (ConfigError, RunError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no output folder was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
