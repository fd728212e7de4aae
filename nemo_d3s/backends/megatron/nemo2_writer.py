"""Writing megatron-core ``dist_checkpointing`` checkpoints: NeMo 2 (``nemo-d3s-convert
megatron-to-nemo``; layout and reader: ``formats/nemo2.py``) and Megatron-LM /
Megatron-Bridge (``nemo-d3s-convert hf-to-megatron-lm``; layout and reader:
``formats/mcore_config.py``, ``formats/mcore_dist.py``). The writer needs megatron-core."""

from __future__ import annotations

import logging

from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from nemo_d3s.formats.spec import ModelSpec
from nemo_d3s.formats.nemo2 import NEMO_PREFIX, nemo_key
from nemo_d3s.formats.weights import Layout, local_names

__all__ = [
    "write_nemo2",
    "write_dist_checkpoint",
    "te_extra_state_modules",
    "te_expert_extra_state_modules",
]


class _TorchOnCpu:
    """megatron-core's dist_checkpointing hard-codes CUDA (a failure flag on
    ``torch.cuda.current_device()``, ``device='cuda'`` flags, a CUDA sync): for the length of
    a save on a CPU-only process, those modules see the backend's CPU view of torch
    (``cpu_compat``'s proxy); torch itself is untouched and the modules are restored.
    Without psutil, its memory logging in the writer processes reads 0 instead of failing
    (a failed writer process would leave megatron-core's saver waiting forever)."""

    MODULES = (
        "megatron.core.dist_checkpointing.strategies.state_dict_saver",
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
        "megatron.core.dist_checkpointing.strategies.async_utils",
    )

    def __enter__(self):
        import importlib
        import importlib.util

        from nemo_d3s.backends.megatron.cpu_compat import CpuTorch

        self.saved = []
        fs = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
        if importlib.util.find_spec("psutil") is None:  # only for its memory log lines
            self.saved.append((fs, "_process_memory", fs._process_memory))
            fs._process_memory = lambda: 0
        if torch.cuda.is_available():
            return self
        for name in self.MODULES:
            mod = importlib.import_module(name)
            if isinstance(getattr(mod, "torch", None), type(torch)):
                self.saved.append((mod, "torch", mod.torch))
                mod.torch = CpuTorch()
        return self

    def __exit__(self, *exc) -> None:
        for mod, name, real in self.saved:
            setattr(mod, name, real)


def _one_process_group():
    """A private one-rank gloo group when none exists (torch.distributed is needed by
    megatron-core's saver); returns a teardown."""
    import torch.distributed as dist

    if dist.is_initialized():
        return lambda: None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.destroy_process_group


def write_nemo2(
    tensors: Iterator[Tuple[str, torch.Tensor]], spec: ModelSpec, out: Path, *, padded_vocab: int
) -> None:
    """Write the HF-named ``tensors`` of ``spec`` as ``out/weights`` (NeMo's names, TP1
    global tensors, per-layer ShardedTensors, ``_extra_state`` objects) with megatron-core's
    ``dist_checkpointing.save``. The caller copies ``context/``."""
    write_dist_checkpoint(tensors, spec, out / "weights", padded_vocab=padded_vocab)


def write_dist_checkpoint(
    tensors: Iterator[Tuple[str, torch.Tensor]],
    spec: ModelSpec,
    folder: Path,
    *,
    padded_vocab: int,
    prefix: str = NEMO_PREFIX,
    model_key: Optional[str] = None,
    common: Optional[Dict[str, Any]] = None,
) -> None:
    """Write the HF-named ``tensors`` of ``spec`` into the new folder ``folder`` with
    megatron-core's ``dist_checkpointing.save``, as a GPTModel's ``sharded_state_dict`` holds
    them: keys ``prefix`` + the model's transformer-engine names, TP1 global tensors (the
    vocabulary padded to ``padded_vocab`` rows with zeros), each layer a ShardedTensor at its
    index of the stacked ``decoder.layers.*`` key, the ``_extra_state`` objects of the TE
    modules (None: nothing to restore). ``model_key``: nest the model under it
    (Megatron-LM's "model"); ``common``: plain entries saved beside it (Megatron-LM's args,
    iteration, checkpoint_version: in ``common.pt`` up to megatron-core 0.18, a DCP byte item
    from 0.19, ``formats/mcore_config.py``). Holds the whole model in memory (megatron-core's
    saver takes the full state dict)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from nemo_d3s.formats.weights import read_local

    full = dict(tensors)

    class _Dict:
        def rows(self, name, dim, lo, hi):
            return full[name].narrow(dim, lo, hi - lo)

    layout = Layout(1, 1, 0, 0, padded_vocab, te=True)
    L = spec.num_layers
    sharded: Dict[str, Any] = {}
    dtype = full["model.embed_tokens.weight"].dtype
    stacked = (L, spec.num_experts)  # the leading axes: layers, then an expert's experts
    for local in local_names(spec, layout):
        t = read_local(local, spec, layout, _Dict(), dtype)
        fqn, at = nemo_key(local, prefix)
        axes = [(d, i, n) for d, (i, n) in enumerate(zip(at, stacked))]
        sharded[f"{fqn}#{at}"] = ShardedTensor.from_rank_offsets(
            fqn, t, *axes, replica_id=0, prepend_axis_num=len(at)
        )
    per_layer, once = te_extra_state_modules(spec, nemo=prefix == NEMO_PREFIX)
    for layer in range(L):
        for mod in per_layer:
            key = f"{prefix}decoder.layers.{mod}._extra_state"
            sharded[f"{key}#{layer}"] = ShardedObject(key, None, (L,), (layer,), replica_id=0)
        # TE's grouped linears keep one per expert on the expert axis (megatron-core 0.16.1
        # extensions/transformer_engine.py :1751-1783: offsets (layer, global expert))
        for mod in te_expert_extra_state_modules(spec):
            key = f"{prefix}decoder.layers.{mod}._extra_state"
            for e in range(spec.num_experts):
                sharded[f"{key}#{layer}.{e}"] = ShardedObject(
                    key, None, stacked, (layer, e), replica_id=0
                )
    for mod in once:  # outside the layer stack: megatron-core's offsets (1,), (0,)
        key = f"{prefix}{mod}._extra_state"
        sharded[key] = ShardedObject(key, None, (1,), (0,), replica_id=0)
    state: Dict[str, Any] = {model_key: sharded} if model_key else sharded
    state.update(common or {})
    folder.mkdir(parents=True)
    teardown = _one_process_group()
    # A failed write is logged by the writer ("Local process 0 encountered an error: ...",
    # megatron-core 0.16.1 dist_checkpointing/strategies/filesystem_async.py:321-326; 0.19.2
    # :330) and then raised: the caller reports it once. 0.19.2's synchronous save goes
    # through the async one it deprecates and warns of that (strategies/torch.py:725-751):
    # nothing a user can act on.
    quiet = [
        logging.getLogger(f"megatron.core.dist_checkpointing.strategies.{name}")
        for name in ("filesystem_async", "torch")
    ]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        with _TorchOnCpu():
            dist_checkpointing.save(
                state,
                str(folder),
                content_metadata={
                    "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True,
                    "distrib_optim_sharding_type": "dp_reshardable",
                },
            )
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
        teardown()


def te_extra_state_modules(spec: ModelSpec, *, nemo: bool) -> Tuple[List[str], List[str]]:
    """The TE spec's modules that carry an ``_extra_state`` (TE's fp8 metadata): (per layer,
    under ``decoder.layers.``; once, from the model's root). Every Transformer Engine module
    of megatron-core's ``get_gpt_layer_with_transformer_engine_spec`` has one: the linears and
    the attention (TransformerEngineBaseModule), and TENorm, which is TE's RMSNorm, a fusible
    op with its own ``get_extra_state`` (TE ``pytorch/module/rmsnorm.py``: ``RMSNorm(_RMSNormOp)``;
    ``pytorch/ops/op.py`` ``BasicOperation.get_extra_state``): the q / k norms where the model
    has them and ``decoder.final_layernorm`` (``transformer_block.py``: ``LayerNormImpl =
    TENorm`` under TE). ``nemo``: NeMo 2's checkpoints hold no ``core_attention`` or final-norm
    state (the q / k norms' it does)."""
    per_layer = ["self_attention.linear_proj", "self_attention.linear_qkv"]
    if spec.num_experts:  # MoELayer: an unfused TENorm before it; the router keeps none
        per_layer.append("pre_mlp_layernorm")
        if spec.moe_shared_ffn_hidden_size:  # SharedExpertMLP: TE column / row linears
            per_layer += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    else:
        per_layer += ["mlp.linear_fc1", "mlp.linear_fc2"]
    if not nemo:
        per_layer.append("self_attention.core_attention")
    if spec.qk_norm:
        per_layer += ["self_attention.q_layernorm", "self_attention.k_layernorm"]
    return per_layer, [] if nemo else ["decoder.final_layernorm"]


def te_expert_extra_state_modules(spec: ModelSpec) -> List[str]:
    """The TE spec's grouped expert linears (``TEGroupedMLP``'s ``TEColumnParallelGroupedLinear``
    and ``TERowParallelGroupedLinear``, megatron-core ``moe_module_specs``), whose
    ``_extra_state`` is stored once per layer and expert under ``decoder.layers.``."""
    if not spec.num_experts:
        return []
    return ["mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"]
