"""The two D3S hooks of a Megatron-core trainer, with process groups from ``parallel_state``.

A Megatron GRPO trainer needs two things from nemo_d3s that single-process code does not:

1. Old-policy log-probs AND next-token entropy from the vocab-parallel output layer,
   without gathering the full vocabulary onto one rank:
   ``nemo_d3s.distributed.vocab_parallel_entropy_and_logprobs(logits, target_ids, tp_group)``
   with ``tp_group = parallel_state.get_tensor_model_parallel_group()``. Collectives carry
   O(B x S) floats, never the [B, S, V] logits.
2. The D3S token rule (top K% of |A| x H) over the WHOLE optimizer-step batch, which is
   spread over the data-parallel ranks:
   ``nemo_d3s.distributed.global_top_k_mask(scores, eligible, k, dp_group)`` with
   ``dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)`` (with
   context parallelism each rank holds a slice of the positions, so the pool spans DP x CP).
   It keeps exactly the tokens one process would keep on the concatenated batch; only
   counts travel between ranks.

This script runs both hooks on random data and checks them against the single-process
reference (``nemo_d3s.core``), so it doubles as a smoke test of an installation. CPU, two
gloo ranks, about ten seconds (mostly importing Megatron)::

    torchrun --nproc_per_node=2 examples/megatron_hooks.py            # TP=2 (DP=1)
    torchrun --nproc_per_node=2 examples/megatron_hooks.py --tp 1     # DP=2: global top-k
    torchrun --nproc_per_node=4 examples/megatron_hooks.py --tp 2     # TP=2 x DP=2

On a GPU node the same code runs on NCCL (``--device cuda``, one GPU per rank). Megatron's
``initialize_model_parallel`` itself works on gloo/CPU; nothing here is mocked.

Layout notes for the real trainer:

- Megatron's output layer returns logits ``[S, B, V/TP]``; transpose once to
  ``[B, S, V/TP]`` (a view: the hooks accept any strides).
- Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x TP``; pass
  the real size as ``vocab_size=`` so the padding columns stay out of the softmax.
- The hooks score position s from the logits at s; shift (``logits[:, :-1]`` with
  ``ids[:, 1:]``) and then ``core.entropy.align_to_tokens`` to get token-aligned tensors.
- With pipeline parallelism only the last stage has logits: run hook 1 there and
  broadcast the [B, S] entropy/log-probs to the other stages if they need them.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

# Megatron warns once per module when Transformer Engine / Apex are missing (CPU installs).
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

from megatron.core import parallel_state  # noqa: E402

from nemo_d3s.core import (  # noqa: E402
    align_to_tokens,
    entropy_and_logprobs,
    n_tokens_to_keep,
    token_scores,
    top_k_mask,
)
from nemo_d3s.distributed import global_top_k_mask, vocab_parallel_entropy_and_logprobs  # noqa: E402


# ------------------------------------------------------------------------- the two hooks
def old_policy_logprobs_and_entropy(
    logits_sbv: torch.Tensor, input_ids: torch.Tensor, vocab_size: int
):
    """Hook 1, called on the last pipeline stage in the no-grad old-policy pass.

    logits_sbv [S, B, V_padded/TP] (Megatron's layout, this rank's vocabulary slice);
    input_ids [B, S] -> (old_logprobs [B, S], entropy [B, S]), token-aligned (position 0
    holds 0), identical on every TP rank.
    """
    logits = logits_sbv.transpose(0, 1)  # [B, S, V/TP], a view
    entropy, logprobs = vocab_parallel_entropy_and_logprobs(
        logits[:, :-1],
        input_ids[:, 1:],
        parallel_state.get_tensor_model_parallel_group(),
        vocab_size=vocab_size,
    )
    return align_to_tokens(logprobs), align_to_tokens(entropy)


def select_tokens_dp_global(
    advantages: torch.Tensor, entropy: torch.Tensor, eligible: torch.Tensor, k_frac: float
):
    """Hook 2, called once per optimizer step on every rank, after sample selection.

    advantages [B] (this rank's kept samples), entropy, eligible [B, S] -> token_keep
    [B, S] bool: the top ``ceil(k_frac x eligible tokens of the whole DP batch)`` scores.
    Every rank of the DP group must call it (also a rank with no eligible token).
    """
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    scores = token_scores(advantages, entropy, eligible)
    # k is a GLOBAL count: every rank must pass the same k.
    n_eligible = torch.tensor([int(eligible.sum())], dtype=torch.long, device=eligible.device)
    dist.all_reduce(n_eligible, group=dp_group)
    k = n_tokens_to_keep(int(n_eligible), k_frac)
    # (nemo_d3s.distributed.select_tokens_global(scores, eligible, k_frac, dp_group) does
    # these three lines in one call and also offers the per-rank and quantile scopes.)
    return global_top_k_mask(scores, eligible, k, dp_group)


# ------------------------------------------------------------------------- the demo / check
def padded_vocab(vocab_size: int, tp: int, divisible_by: int = 8) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of divisible_by x TP."""
    m = divisible_by * tp
    return -(-vocab_size // m) * m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tp", type=int, default=2, help="tensor-parallel size (must divide the world size)"
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--k-frac", type=float, default=0.2, help="K: fraction of eligible tokens kept")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    if "RANK" not in os.environ:
        print(
            "launch with torchrun, e.g.: torchrun --nproc_per_node=2 examples/megatron_hooks.py",
            file=sys.stderr,
        )
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device(args.device)
    # A short timeout: a broken demo should fail, not hang for Megatron's default 30 minutes.
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo", timeout=timedelta(seconds=120)
    )
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    try:
        return run_checks(args, device)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_checks(args, device: torch.device) -> int:
    tp, tp_rank = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    dp, dp_rank = (
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_rank(),
    )
    rank0 = dist.get_rank() == 0

    # Every rank draws the same GLOBAL batch from one seed and keeps its own part of it:
    # rows of its DP rank, columns of its TP vocabulary slice. That lets each rank compare
    # against the full-vocabulary, full-batch reference computed locally.
    V = 50  # real vocabulary; padded below as Megatron does
    Vp = padded_vocab(V, tp)
    b, S = 4, 16  # rollouts per DP rank, sequence length
    g = torch.Generator().manual_seed(args.seed)
    full_logits = torch.randn(S, dp * b, Vp, generator=g) * 3.0  # Megatron layout [S, B, Vp]
    ids = torch.randint(0, V, (dp * b, S), generator=g)
    advantages = torch.randn(dp * b, generator=g)
    resp_len = torch.randint(2, S - 2, (dp * b,), generator=g)
    eligible = torch.arange(S) >= (S - resp_len[:, None])  # response = last resp_len tokens

    rows = slice(dp_rank * b, (dp_rank + 1) * b)
    cols = slice(tp_rank * Vp // tp, (tp_rank + 1) * Vp // tp)  # Megatron's even vocab split
    local_logits = full_logits[:, rows, cols].contiguous().to(device).requires_grad_(True)
    local_ids, local_elig = ids[rows].to(device), eligible[rows].to(device)

    # Hook 1 ------------------------------------------------------------------------------
    old_lp, ent = old_policy_logprobs_and_entropy(local_logits, local_ids, vocab_size=V)
    # The log-probs are differentiable (the same call serves the training forward pass):
    # backward runs no collective and gives this rank its slice of the vocabulary gradient.
    old_lp.sum().backward()

    ref_logits = full_logits[:, rows, :V].transpose(0, 1).clone().requires_grad_(True)
    ref_ent, ref_lp = entropy_and_logprobs(ref_logits[:, :-1], ids[rows, 1:])
    align_to_tokens(ref_lp).sum().backward()
    ref_grad = torch.zeros(S, b, Vp)
    ref_grad[:, :, :V] = ref_logits.grad.transpose(0, 1)  # padding columns: zero gradient
    torch.testing.assert_close(
        old_lp.detach().cpu(), align_to_tokens(ref_lp).detach(), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(ent.cpu(), align_to_tokens(ref_ent), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(local_logits.grad.cpu(), ref_grad[:, :, cols], rtol=1e-5, atol=1e-6)
    dist.barrier()
    if rank0:
        print(
            "hook 1: vocab-parallel entropy/log-probs match the full-vocabulary reference "
            f"(TP={tp}, vocab {V} padded to {Vp}, logits [S={S}, B={b}, V/TP={Vp // tp}] "
            "per rank); gradients match too"
        )

    # Hook 2 ------------------------------------------------------------------------------
    # Same scores as the reference: use the reference entropy of ALL rows, so the single-process
    # top-k can be computed on the concatenated batch.
    all_ent = align_to_tokens(
        entropy_and_logprobs(full_logits[:, :, :V].transpose(0, 1)[:, :-1], ids[:, 1:])[0]
    )
    keep = select_tokens_dp_global(
        advantages[rows].to(device), all_ent[rows].to(device), local_elig, args.k_frac
    )

    k = n_tokens_to_keep(int(eligible.sum()), args.k_frac)
    ref_keep = top_k_mask(token_scores(advantages, all_ent, eligible), eligible, k)
    if not torch.equal(keep.cpu(), ref_keep[rows]):
        print(
            f"rank {dist.get_rank()}: global top-k differs from the single-process top-k",
            file=sys.stderr,
        )
        return 1
    # What a per-rank top-k (each rank keeps K of its own tokens, no collective) would do
    # instead: a different set whenever the ranks' score distributions differ.
    local_scores = token_scores(advantages[rows], all_ent[rows], eligible[rows])
    per_rank = top_k_mask(
        local_scores, eligible[rows], n_tokens_to_keep(int(eligible[rows].sum()), args.k_frac)
    )
    counts = torch.tensor([int(keep.sum()), int((per_rank != keep.cpu()).sum())], device=device)
    dist.all_reduce(counts)  # over the world: each TP replica counts the same DP rows
    n_kept, n_differ = (int(c) // tp for c in counts)
    if rank0:
        print(
            f"hook 2: global top-k over DP={dp} keeps {n_kept}/{int(eligible.sum())} tokens "
            f"(K={args.k_frac}), the same tokens as the single-process top-k on the whole batch"
        )
        if dp > 1:
            print(
                f"        a per-rank top-k would have changed {n_differ} of these token decisions"
            )
        print("megatron hooks OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
