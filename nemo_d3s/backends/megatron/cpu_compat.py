"""Running megatron-core (0.15, 0.16, 0.19) on CPU / gloo ranks: the backend's one set of patches.

Redirects the few CUDA assumptions of the GPTModel path (local spec, CPU init, any TP x PP,
sequence parallelism, DDP + distributed optimizer, RoPE's per-CP-rank cut, MoE router and
dispatchers) to the CPU; the rest runs unchanged (MoE's other CUDA calls:
``cpu_compat_moe.py``). Process-wide for megatron-core, so NEVER apply it in a process that
runs Megatron on CUDA; ``torch`` itself is not patched, only megatron's view of it.
Unsupported on CPU: default causal masks, ``distribute_saved_activations``, GPU init, KV
caches, CUDA graphs, autocast and Transformer Engine specs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from nemo_d3s.backends.megatron.cpu_compat_moe import (
    MOE_TORCH_PROXIED,
    CpuDistributed,
    patch_dtoh_copies,
    patch_router_gemm,
)

__all__ = ["apply_cpu_compat", "is_applied", "seed_model_parallel"]

# megatron-core modules whose module-level ``torch`` becomes a :class:`CpuTorch` proxy.
# module -> the functions that hard-code CUDA there (all on the GPT path at TP x PP on gloo).
# Narrow on purpose: a global ``torch.cuda.current_device = lambda: "cpu"`` would also reach
# every other caller in the process (nemo_d3s.distributed picks its device with it) and
# cannot be undone per module; the proxies change megatron's view only.
_TORCH_PROXIED = {
    # RotaryEmbedding.get_emb moves ``inv_freq`` to ``torch.cuda.current_device()`` at the
    # first forward (and __init__ allocates there without use_cpu_initialization).
    "megatron.core.models.common.embeddings.rotary_pos_embedding": (
        "RotaryEmbedding.__init__/get_emb"
    ),
    # forward_backward_no_pipelining and both 1F1B schedules allocate the token counter with
    # ``torch.zeros([], dtype=torch.int, device="cuda")``.
    "megatron.core.pipeline_parallel.schedules": "forward_backward_* total_num_tokens",
    # P2PCommunicator allocates receive buffers (and shape tensors for variable sequence
    # lengths) on ``torch.cuda.current_device()`` and calls ``torch.cuda.synchronize()``
    # after batch_isend_irecv (config.batch_p2p_sync, True by default) at PP > 1.
    "megatron.core.pipeline_parallel.p2p_communication": "P2PCommunicator._communicate(_shapes)",
    # GlobalMemoryBuffer.get_tensor allocates on ``torch.cuda.current_device()``: the
    # baddbmm input buffer of DotProductAttention.forward (local spec) comes from it.
    "megatron.core.utils": "GlobalMemoryBuffer.get_tensor",
    # Megatron's DistributedDataParallel + distributed optimizer (model.params.
    # distributed_optimizer=true on CPU, how the tests run the GPU path's logic on gloo):
    # _ParamAndGradBuffer.__init__ allocates the contiguous param and grad buffers on
    # ``torch.cuda.current_device()``; 0.19's _ParamAndGradBucketGroup.start_grad_sync waits
    # on ``torch.cuda.current_stream()`` for CUDA-graph events (param_and_grad_buffer.py:632);
    "megatron.core.distributed.param_and_grad_buffer": "_ParamAndGradBuffer.__init__, "
    "_ParamAndGradBucketGroup.start_grad_sync (0.19)",
    # MixedPrecisionOptimizer.__init__ puts found_inf / _dummy_overflow_buf / _scale_one on
    # device="cuda" and get_loss_scale falls back to ``torch.cuda.current_device()``;
    "megatron.core.optimizer.optimizer": "MixedPrecisionOptimizer.__init__/get_loss_scale",
    # the global-norm and clipping helpers all-reduce a device="cuda" norm tensor;
    "megatron.core.optimizer.clip_grads": "get_grad_norm_fp32/clip_grad_by_total_norm_fp32",
    # the optimizer-state load path allocates its shards on ``torch.cuda.current_device()``.
    "megatron.core.optimizer.distrib_optimizer": (
        "DistributedOptimizer.load_parameter_state_from_dp_zero"
    ),
    # Sequence parallelism (model.params.sequence_parallel=true, TP > 1): the sequence
    # gathers / reduce-scatters of the embedding and the norms' region allocate their
    # outputs on ``torch.cuda.current_device()`` (_gather_along_first_dim,
    # _reduce_scatter_along_first_dim);
    "megatron.core.tensor_parallel.mappings": "_gather/_reduce_scatter_along_first_dim",
    # and LinearWithGradAccumulationAndAsyncCommunication.backward reduce-scatters the input
    # gradient of a sequence-parallel linear into a ``torch.cuda.current_device()`` buffer.
    "megatron.core.tensor_parallel.layers": (
        "LinearWithGradAccumulationAndAsyncCommunication.backward"
    ),
    # Mixture-of-experts layers: see :data:`MOE_TORCH_PROXIED`.
    **MOE_TORCH_PROXIED,
}

_APPLIED = False


class _CpuStream:
    """``torch.cuda.current_stream()`` on CPU: ops and gloo waits are synchronous, so no-ops."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> "_CpuStream":
        return self  # an event whose synchronize() has nothing to wait for


class _CpuCuda:
    """``torch.cuda`` as the proxied megatron modules see it."""

    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _CpuStream:  # noqa: N802 (torch's name)
        return _CpuStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None  # CPU ops and gloo's wait() are synchronous: nothing to wait for

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args: Any, device: Any = None, **kwargs: Any):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    return wrapper


class CpuTorch:
    """``torch`` as the proxied megatron modules see it: CUDA-placed factories and
    ``torch.cuda.current_device/synchronize`` go to the CPU; all else is torch itself."""

    cuda = _CpuCuda()
    distributed = CpuDistributed()
    zeros = staticmethod(_on_cpu(torch.zeros))
    ones = staticmethod(_on_cpu(torch.ones))
    empty = staticmethod(_on_cpu(torch.empty))
    tensor = staticmethod(_on_cpu(torch.tensor))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CPU_TORCH = CpuTorch()


def _proxy_torch() -> None:
    import importlib

    for name in _TORCH_PROXIED:
        module = importlib.import_module(name)
        if module.torch is torch:
            module.torch = _CPU_TORCH


def _patch_tied_embedding_copy() -> None:
    """``Tensor.cuda`` is the identity inside ``setup_embeddings_and_output_layer`` (tied
    embeddings at PP > 1 call ``weight.data.cuda()``, a method no module proxy reaches)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "_nemo_d3s_cpu", False):
        return

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor
        try:
            original(self)
        finally:
            torch.Tensor.cuda = cuda

    setup_embeddings_and_output_layer._nemo_d3s_cpu = True
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _patch_rng() -> None:
    """CPU twin of Megatron's CUDA-only RNG bookkeeping (``tensor_parallel.random``).

    The tracker keeps one CPU generator state per name and swaps it in inside ``fork``, so
    TP-region dropout draws per-TP-rank streams (an unseeded name uses the current stream).
    Activation recompute saves / restores an empty CUDA state; the CPU and tracker states
    still replay equal dropout masks.
    """
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker
    if getattr(tracker.fork, "_nemo_d3s_cpu", False):
        return

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            yield
            return
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()  # a new tensor: saved copies stay valid
            torch.set_rng_state(outer)

    def get_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
        return None

    add._nemo_d3s_cpu = fork._nemo_d3s_cpu = True
    tracker.add, tracker.fork = add, fork
    mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = (
        get_cuda_rng_state,
        set_cuda_rng_state,
    )


@contextlib.contextmanager
def _cuda_type_names():
    """``Tensor.type()`` names CPU tensors "torch.cuda.*" inside the block (the distributed
    optimizer groups and the clipping helper asserts by those names); casts are untouched."""
    original = torch.Tensor.type

    def type_(tensor, *args: Any, **kwargs: Any):
        if args or kwargs:
            return original(tensor, *args, **kwargs)
        name = original(tensor)
        return name.replace("torch.", "torch.cuda.", 1) if tensor.device.type == "cpu" else name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _patch_distributed_optimizer() -> None:
    """Run DistributedOptimizer.__init__ and the clipping call inside :func:`_cuda_type_names`."""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls.__init__, "_nemo_d3s_cpu", False):
        return

    def scoped(fn):
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any):
            with _cuda_type_names():
                return fn(*args, **kwargs)

        wrapper._nemo_d3s_cpu = True
        return wrapper

    cls.__init__ = scoped(cls.__init__)
    optimizer.clip_grad_by_total_norm_fp32 = scoped(optimizer.clip_grad_by_total_norm_fp32)


def _patch_rope_cp_cut() -> None:
    """RoPE's table cut to this CP rank's two chunks without pinned memory and ``.cuda()``
    (``get_pos_emb_on_this_cp_rank``, megatron-core 0.16.1 / 0.19.2 rope_utils.py:48-69), in
    every rotary module that imported it by name."""
    import importlib

    from nemo_d3s.core.context_parallel import zigzag_positions

    def cut(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
        S = pos_emb.shape[seq_dim]
        mine = zigzag_positions(torch.tensor([0, S]), cp_group.size(), cp_group.rank())
        return pos_emb.index_select(seq_dim, mine.to(pos_emb.device))

    for name in ("rotary_pos_embedding", "yarn_rotary_pos_embedding", "rope_utils"):
        module = importlib.import_module(f"megatron.core.models.common.embeddings.{name}")
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = cut


def apply_cpu_compat() -> None:
    """Make megatron-core run on CPU / gloo in this process (idempotent); before building
    the model, never in a process that runs Megatron on CUDA."""
    global _APPLIED
    if _APPLIED:
        return
    _proxy_torch()
    _patch_tied_embedding_copy()
    _patch_rng()
    _patch_distributed_optimizer()
    _patch_rope_cp_cut()
    patch_router_gemm()
    patch_dtoh_copies()
    _APPLIED = True


def is_applied() -> bool:
    """Whether :func:`apply_cpu_compat` ran in this process."""
    return _APPLIED


def seed_model_parallel(seed: int) -> None:
    """Seed torch and Megatron's RNG tracker as Megatron's training loop does (TP state
    ``seed + 2718 + tp_rank``); after the groups exist, before building the model. A
    CPU-only build needs :func:`apply_cpu_compat` first."""
    if not torch.cuda.is_available() and not _APPLIED:
        raise RuntimeError("seed_model_parallel on a CPU-only build needs apply_cpu_compat() first")
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
