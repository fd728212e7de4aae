"""The CPU twin of the vLLM refit checks over the gloo ranks. ``refit.staged_tp_pp``: the
Megatron policy at TP 2 and at PP 2 refitted through the shared-memory staging buffer in
quarter-layer buckets into a layer-wise receiver; every worker's tensors equal the trainer's
bit for bit. ``NEMO_D3S_FAULT=selfcheck.refit_sink@<n>=enospc`` fails the n-th bucket, and
the refit's agreement fails the check on every rank.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from nemo_d3s.selfcheck.base import Check, Context, megatron_backend, need_world

__all__ = ["CHECKS", "LayerwiseReceiver"]


class LayerwiseReceiver:
    """An engine stand-in on the refit's src rank: ``workers`` readers (slots 0..workers-1), each
    holding a layer's tensors until the layer is complete, as vLLM 0.33's layer-wise reload does
    (``reload/layerwise.py:185, 217-218``).
    """

    def __init__(self, names: List[str], workers: int) -> None:
        from nemo_d3s.backends.staging import StagedBucketReader, shm_key

        self.layers: Dict[str, set] = {}
        for n in names:
            self.layers.setdefault(n.rsplit(".", 1)[0], set()).add(n)
        cpu = torch.device("cpu")
        self.readers = [StagedBucketReader(cpu, shm_key(w)) for w in range(workers)]
        self.loaded: List[Dict[str, torch.Tensor]] = [{} for _ in range(workers)]
        self.buckets = 0

    def begin_refit(self) -> None:
        self.pending: List[Dict[str, Dict[str, torch.Tensor]]] = [{} for _ in self.readers]

    def load_staged_bucket(self, meta, handles) -> None:
        from nemo_d3s.trainer.faults import fault_point

        fault_point("selfcheck.refit_sink")
        self.buckets += 1
        for w, reader in enumerate(self.readers):
            for name, t in reader.read(meta, handles):
                layer = name.rsplit(".", 1)[0]
                kept = self.pending[w].setdefault(layer, {})
                kept[name] = t
                if set(kept) == self.layers[layer]:
                    self.loaded[w].update({n: v.clone() for n, v in kept.items()})
                    del self.pending[w][layer]

    def end_refit(self) -> None:
        for r in self.readers:
            r.close()


def _one_layout(ctx: Context, tp: int, pp: int, problems: List[str]) -> Dict[str, Any]:
    import torch.distributed as dist

    from nemo_d3s.backends.refit import WeightRefit

    with megatron_backend(
        ctx, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    ) as pol:
        trainer = {n: t.detach().cpu().clone() for n, t in pol.hf_weights()}
        layer = sum(t.numel() * t.element_size() for n, t in trainer.items() if ".layers.0." in n)
        mp, src = pol.mp_group()
        group = pol.mp_gloo_group() if mp is not None else None
        workers = tp  # an engine of the training TP, on the GPUs of ranks src..src+tp-1
        rank = dist.get_rank()
        sink = LayerwiseReceiver(list(trainer), workers) if rank == src else None
        refit = WeightRefit(
            sink,
            transport="shm",
            group=group,
            src=src,
            hosts_engine_gpu=0 <= rank - src < workers,
            bucket_bytes=max(1, layer // 4),
        )
        stats = refit.push(pol.refit_weights())  # raises on every rank when one failed
        if sink is not None:
            for w, got in enumerate(sink.loaded):
                bad = [n for n, t in trainer.items() if n not in got or not torch.equal(got[n], t)]
                if bad:
                    problems.append(
                        f"TP{tp} PP{pp} worker {w}: {len(bad)} tensors differ ({bad[0]})"
                    )
    return {"buckets": stats.buckets, "layer_bytes": layer, "staged_bytes": stats.staged_bytes}


def check_staged_tp_pp(ctx: Context) -> Dict[str, Any]:
    need_world(ctx, 2, "a refit from TP 2 / PP 2 ranks")
    problems: List[str] = []
    out: Dict[str, Any] = {}
    for tp, pp in ((2, 1), (1, 2)):
        res = _one_layout(ctx, tp, pp, problems)
        out.update({f"tp{tp}pp{pp}_{k}": v for k, v in res.items()})
    ctx.agree(problems, out)
    return out


CHECKS = [Check("refit.staged_tp_pp", False, check_staged_tp_pp)]
