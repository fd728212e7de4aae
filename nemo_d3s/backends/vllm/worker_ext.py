"""Methods vLLM mixes into its worker class (``LLM(worker_extension_cls=...)``), named by
import path, so the trainer can call them with ``collective_rpc`` by name: no function or
object is pickled across the process boundary."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

__all__ = ["WeightLoaderExtension", "decode_weights", "encode_weights"]

Payload = List[Tuple[str, bytes, str, List[int]]]


def encode_weights(weights: Sequence[Tuple[str, torch.Tensor]]) -> Payload:
    """(name, tensor) -> (name, raw bytes, dtype name, shape): plain types that vLLM's
    msgpack RPC carries as they are (tensors would arrive as untyped tuples)."""
    return [(n, t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes(),
             str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in weights]


def decode_weights(payload: Payload) -> List[Tuple[str, torch.Tensor]]:
    out = []
    for name, raw, dtype, shape in payload:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"weight {name!r}: unknown dtype {dtype!r}")
        out.append((name, torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)))
    return out


class WeightLoaderExtension:
    """Mixed into vLLM's worker: ``self`` is the worker."""

    def load_encoded_weights(self, payload: Payload):
        return self.reload_weights(weights_iterator=decode_weights(payload))
