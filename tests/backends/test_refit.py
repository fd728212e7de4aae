"""The weight refit (``backends/refit.py``) without vLLM: bucket bounds, what each rank copies,
the gather of staging handles on the engine's rank, freeing cached CUDA memory before an
engine wakes, and what crosses to the engine being plain values.

The CUDA IPC transport's two CUDA calls (export, open) cannot run here; its protocol does,
with a CPU stand-in for the staging step that carries the bucket's bytes where the real one
carries a handle to a GPU buffer holding them."""

from __future__ import annotations

import pickle

import pytest
import torch

from nemo_d3s.backends import refit as R
from nemo_d3s.distributed import run_on_gloo_ranks


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "a": (10, 8),
        "b": (3,),
        "c": (40, 10),
        "d": (7, 7),
        "e": (2, 2),
        "f": (64, 16),
    }  # f: 4096 B > bucket
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


class HostSink:
    """Records what an engine would receive."""

    def __init__(self):
        self.calls, self.loaded, self.payload_bytes = [], {}, []

    def begin_refit(self):
        self.calls.append("begin")

    def load_host_bucket(self, meta, raw):
        pickle.dumps((meta, raw))  # plain: what vLLM's RPC must carry
        self.payload_bytes.append(len(raw))
        self.loaded.update({n: t.clone() for n, t in R.decode_host(meta, raw)})

    def load_ipc_bucket(self, meta, handles):
        pickle.dumps((meta, handles))
        self.payload_bytes.append(sum(len(h) for h in handles.values()))
        self.calls.append(sorted(handles))
        raw = handles[sorted(handles)[0]]
        self.loaded.update({n: t.clone() for n, t in R.decode_host(meta, raw)})

    def end_refit(self):
        self.calls.append("end")


def test_buckets_are_bounded_and_the_engine_gets_the_trainers_weights():
    w = _weights()
    sink = HostSink()
    stats = R.WeightRefit(sink, transport="host", bucket_bytes=2000).push(iter(w.items()))
    assert sink.calls == ["begin", "end"]
    # every payload within one bucket, except a tensor larger than a bucket, which goes alone
    big = {n: t.numel() * 4 for n, t in w.items() if t.numel() * 4 > 2000}
    assert big == {"f": 4096}
    assert max(b for b in sink.payload_bytes if b != 4096) <= 2000
    assert stats.max_bucket_bytes == 4096 and stats.total_bytes == sum(
        t.numel() * 4 for t in w.values()
    )
    assert stats.buckets == len(sink.payload_bytes) >= 3
    assert sink.loaded.keys() == w.keys()
    for n, t in w.items():
        assert torch.equal(sink.loaded[n], t), n


def test_refit_casts_to_the_engines_dtype_before_it_moves():
    w = _weights()
    sink = HostSink()
    R.WeightRefit(sink, transport="host", bucket_bytes=2000, dtype=torch.bfloat16).push(
        iter(w.items())
    )
    assert sum(sink.payload_bytes) == sum(t.numel() * 2 for t in w.values())
    assert all(
        sink.loaded[n].dtype == torch.bfloat16 and torch.equal(sink.loaded[n], t.bfloat16())
        for n, t in w.items()
    )


def test_iter_buckets_keeps_order_and_offsets():
    w = _weights()
    buckets = list(R.iter_buckets(iter(w.items()), 2000))
    assert [m[0] for b in buckets for m in b.meta] == list(w)
    for b in buckets:
        assert [m[3] for m in b.meta] == [
            sum(t.numel() * 4 for t in b.tensors[:i]) for i in range(len(b.tensors))
        ]
        assert b.nbytes == sum(t.numel() * 4 for t in b.tensors)


def _cpu_stage(refit, bucket):
    """CPU stand-in for ``stage_cuda_ipc``: (this rank's 'GPU', the bucket's bytes)."""
    import torch.distributed as dist

    refit.staged_calls = getattr(refit, "staged_calls", 0) + 1
    return f"gpu{dist.get_rank()}", R.pack_host(bucket)


def _rank_body(rank: int, hosts: list, transport: str):
    import torch.distributed as dist

    group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    w = _weights()
    sink = HostSink() if rank == 0 else None
    packed = []
    real_pack = R.pack_host

    def spy_pack(bucket):
        packed.append(bucket.nbytes)
        return real_pack(bucket)

    R.pack_host = spy_pack
    try:
        refit = R.WeightRefit(
            sink,
            transport=transport,
            group=group,
            src=0,
            hosts_engine_gpu=hosts[rank],
            bucket_bytes=2000,
            stage=_cpu_stage,
        )
        stats = refit.push(iter(w.items()))
    finally:
        R.pack_host = real_pack
    out = {
        "staged_bytes": stats.staged_bytes,
        "staged_calls": getattr(refit, "staged_calls", 0),
        "host_packed": sum(packed),
    }
    if rank == 0:
        out["calls"] = [c if isinstance(c, str) else ",".join(c) for c in sink.calls]
        out["equal"] = (
            all(torch.equal(sink.loaded[n], t) for n, t in w.items())
            and sink.loaded.keys() == w.keys()
        )
    return out


@pytest.mark.distributed
def test_ipc_protocol_gathers_the_engine_gpus_handles_and_other_ranks_copy_nothing():
    """3 ranks of one model copy; the engine (on rank 0) has two GPUs, ranks 0 and 1's; rank 2
    (another stage's GPU) only serves the source: it stages nothing and packs nothing."""
    res = run_on_gloo_ranks(_rank_body, 3, [True, True, False], "cuda_ipc", timeout=120)
    r0, r1, r2 = res
    assert r0["equal"]
    buckets = [c for c in r0["calls"] if c not in ("begin", "end")]
    assert r0["calls"][0] == "begin" and r0["calls"][-1] == "end" and len(buckets) >= 3
    assert all(c == "gpu0,gpu1" for c in buckets)  # one handle per engine GPU, none from rank 2
    assert r1["staged_calls"] == len(buckets) and r1["staged_bytes"] == r0["staged_bytes"] > 0
    assert r2["staged_calls"] == 0 and r2["staged_bytes"] == 0
    # the stand-in stager packs bytes (the real one copies GPU to GPU); outside it nobody packs
    assert r2["host_packed"] == 0


@pytest.mark.distributed
def test_host_protocol_only_the_engines_rank_packs():
    r0, r1 = run_on_gloo_ranks(_rank_body, 2, [True, True], "host", timeout=120)
    assert r0["equal"] and r0["host_packed"] == sum(t.numel() * 4 for t in _weights().values())
    assert r1["host_packed"] == 0 and r1["staged_calls"] == 0


def test_free_cached_cuda_memory_only_on_a_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("sync", str(d))))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty",)))
    assert not R.release_cached_cuda_memory(
        torch.device("cpu")
    ) and not R.release_cached_cuda_memory(None)
    assert calls == []
    assert R.release_cached_cuda_memory(torch.device("cuda", 3))
    assert calls == [("sync", "cuda:3"), ("empty",)]
    monkeypatch.setattr(
        torch.cuda, "is_initialized", lambda: False
    )  # nothing cached: nothing to free
    assert not R.release_cached_cuda_memory(torch.device("cuda", 0))


def test_every_refit_frees_the_cache_before_the_engine_wakes(monkeypatch):
    order = []
    monkeypatch.setattr(R, "release_cached_cuda_memory", lambda d: order.append(("free", str(d))))

    class Sink(HostSink):
        def begin_refit(self):
            order.append("wake")

    R.WeightRefit(Sink(), transport="host", device=torch.device("cuda", 1)).push(
        iter(_weights().items())
    )
    assert order == [("free", "cuda:1"), "wake"]


def test_plain_ipc_handle_is_builtins_only():
    """What ``reduce_tensor`` gives for a CUDA tensor (15 arguments of rebuild_cuda_tensor,
    torch/multiprocessing/reductions.py), made plain: no class objects, no torch types."""
    args = (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        3,
        b"\x01" * 64,
        4096,
        512,
        False,
        b"ref",
        8,
        b"\x02" * 64,
        True,
    )
    plain = R.plain_ipc_handle(args)
    allowed = (int, bool, bytes, str, list, type(None))
    assert all(isinstance(x, allowed) for x in plain)
    assert plain[0] == [4096] and plain[3] == "uint8" and plain[4] == 3
    assert pickle.loads(pickle.dumps(plain)) == plain
