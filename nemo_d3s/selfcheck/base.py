"""What the check modules share: :class:`Check`, the per-rank :class:`Context`, the tiny model,
helpers. A check is ``fn(ctx) -> {measured numbers}``, called by every rank at the same point
(it may run collectives on the world); it raises ``report.NotRun`` or ``report.CheckFailed``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.selfcheck.report import CheckFailed, NotRun

__all__ = [
    "Check",
    "Context",
    "TINY",
    "build_tiny_model",
    "max_abs_diff",
    "megatron_backend",
    "need_world",
    "within",
]


@dataclass(frozen=True)
class Check:
    """``what``: what a CUDA check would check, reported (``would_check``) where it cannot run."""

    name: str
    needs_cuda: bool
    fn: Callable[["Context"], Optional[Dict[str, Any]]]
    what: str = ""


@dataclass
class Context:
    """This rank in the job (rank, world, local_rank, cuda, ``device``), the model folder the checks
    load (``tiny``: the self-check's own), ``work_dir`` (seen by every rank) and ``cache`` (what a
    check leaves for a later one). A check must not raise on one rank while others still have its
    collectives to run: raise after the last collective, or call :meth:`agree`.
    """

    rank: int
    world: int
    local_rank: int
    cuda: bool
    device: torch.device
    model_dir: Path
    tiny: bool
    work_dir: Path
    cache: Dict[str, Any] = field(default_factory=dict)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def agree(self, problems: List[str], measured: Optional[Dict[str, Any]] = None) -> None:
        """Collective: raise CheckFailed on every rank when any rank has ``problems``
        (each prefixed with its rank when the world has several)."""
        everyone = [list(problems)]
        if self.world > 1:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, list(problems))
        flat = [
            p if self.world == 1 else f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps
        ]
        if flat:
            raise CheckFailed("; ".join(flat), measured)

    @property
    def tp(self) -> int:
        """The tensor-parallel size the multi-rank checks use: 2 when the world is even."""
        return 2 if self.world % 2 == 0 else 1


# The self-check's model: a random Llama, GQA, every size divisible by TP2 and PP2, a
# vocabulary (byte tokens) that the Megatron layout pads. Seconds to build and run on a CPU.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def build_tiny_model(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny random Llama + the byte-level tokenizer to ``folder`` (HF layout);
    ``overrides``: fields of ``TINY`` to change (``num_hidden_layers=4``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nemo_d3s.backends.hf.loading import byte_level_tokenizer

    tok = byte_level_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        initializer_range=0.2,
        **{**TINY, **overrides},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def need_world(ctx: Context, n: int, what: str) -> None:
    """NotRun unless the self-check runs on at least ``n`` ranks."""
    if ctx.world < n:
        raise NotRun(
            f"{what} needs {n}+ ranks; this run has {ctx.world} (launch under torchrun/srun)"
        )


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in fp32 on the CPU (0 for empty tensors)."""
    return (
        float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max())
        if a.numel()
        else 0.0
    )


def within(name: str, value: float, bound: float, measured: Dict[str, Any]) -> None:
    """Record ``value`` under ``name`` and fail the check when it exceeds ``bound``."""
    measured[name] = value
    measured[f"{name}_bound"] = bound
    if not value <= bound:  # NaN fails too
        raise CheckFailed(f"{name}={value:.3g} > {bound:.3g}", measured)


def run_transformer_impl(ctx: Context) -> Tuple[str, Optional[str]]:
    """The layer spec of the checks that test the trainer rather than the spec (the RL run, the
    checkpoint round trip) and why: ``transformer_engine`` where TE imports or on CPU (where the
    backend uses the local spec anyway); on CUDA without TE, ``local`` with the reason, so one
    missing library is the TE checks' failure and not every later check's as well."""
    if not ctx.cuda:
        return "transformer_engine", None
    from nemo_d3s.backends.megatron.model import transformer_engine_error

    err = transformer_engine_error()
    if err is None:
        return "transformer_engine", None
    return "local", f"local spec: Transformer Engine absent (gpt.te_spec: {err.split(':')[0]})"


@contextlib.contextmanager
def megatron_backend(ctx: Context, **params) -> Iterator[Any]:
    """A ``MegatronBackend`` on ``ctx.model_dir`` over the existing world (params: its
    config's fields), shut down (Megatron's groups destroyed) afterwards."""
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    params.setdefault("device", "cuda" if ctx.cuda else "cpu")
    try:
        pol = MegatronBackend(MegatronBackendConfig(model=str(ctx.model_dir), **params))
    except BaseException:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():  # else the next check's layout is refused
            ps.destroy_model_parallel()
        raise
    try:
        yield pol
    finally:
        pol.shutdown()
