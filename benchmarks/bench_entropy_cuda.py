"""Entropy and log-probs of a long RL batch on one GPU: the project's chunked kernel
(``core.entropy.entropy_and_logprobs``, what every TP-1 rank runs) against the plain
``log_softmax`` a trainer writes first, forward + backward, time and peak memory.

    python benchmarks/bench_entropy_cuda.py --out benchmarks/results/entropy_cuda.json

Needs CUDA (exits 2 without). Logits [B, S, V] bf16 are made once; each method's peak is the
allocator's peak above them. Writes the JSON and a bar plot beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def plain(logits: torch.Tensor, targets: torch.Tensor):
    """The obvious version: the whole [B, S, V] in fp32, twice."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return entropy.detach(), logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def chunked(logits: torch.Tensor, targets: torch.Tensor, chunk_size: int):
    from nemo_d3s.core.entropy import entropy_and_logprobs

    return entropy_and_logprobs(logits, targets, chunk_size=chunk_size)


def measure(fn, logits, targets, reps: int):
    """(seconds per forward + backward, peak bytes above the inputs, entropy, logprobs)."""
    dev = logits.device
    out, times = None, []
    for i in range(reps + 1):  # the first call warms up and is not timed
        logits.grad = None
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        t = time.perf_counter()
        entropy, logprobs = fn(logits, targets)
        logprobs.sum().backward()
        torch.cuda.synchronize(dev)
        if i >= 1:
            times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated(dev) - base
        out = (entropy.float(), logprobs.detach().float())
        del entropy, logprobs
    return min(times), peak, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=152064, help="default: Qwen2.5's")
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/entropy_cuda.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_entropy_cuda: needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (args.batch, args.seq, args.vocab)
    logits = (2.0 * torch.randn(shape, device=dev, generator=g)).to(torch.bfloat16)
    logits.requires_grad_(True)
    targets = torch.randint(0, args.vocab, shape[:2], device=dev, generator=g)
    rows = {}
    results = {}
    for name, fn in (("chunked", lambda x, t: chunked(x, t, args.chunk_size)), ("plain", plain)):
        try:
            s, peak, out = measure(fn, logits, targets, args.reps)
        except torch.OutOfMemoryError as e:
            rows[name] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
            continue
        results[name] = out
        rows[name] = {"seconds_fwd_bwd": s, "peak_gib_above_logits": peak / 2**30}
        torch.cuda.empty_cache()
    if len(results) == 2:
        (e1, l1), (e2, l2) = results["chunked"], results["plain"]
        rows["max_abs_diff"] = {
            "entropy": float((e1 - e2).abs().max()),
            "logprobs": float((l1 - l2).abs().max()),
        }
    record = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "shape_BSV": list(shape),
        "dtype": "bfloat16",
        "logits_gib": logits.numel() * logits.element_size() / 2**30,
        "chunk_size": args.chunk_size,
        "reps": args.reps,
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    ok = [k for k in ("chunked", "plain") if "seconds_fwd_bwd" in rows.get(k, {})]
    if ok:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(7, 3))
        ax[0].bar(ok, [rows[k]["seconds_fwd_bwd"] * 1e3 for k in ok])
        ax[0].set_ylabel("ms, forward + backward")
        ax[1].bar(ok, [rows[k]["peak_gib_above_logits"] for k in ok])
        ax[1].set_ylabel("peak GiB above the logits")
        fig.suptitle(
            f"{record['device']}: entropy + log-probs of [{args.batch}, {args.seq}, "
            f"{args.vocab}] bf16",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
