"""The weight refit (``backends/refit.py``, ``backends/staging.py``) without vLLM: bucket
bounds, the one reused staging buffer, the receiver's copy out of it, what each rank stages,
the gather of staging handles on the engine's rank, freeing cached CUDA memory before an
engine wakes, and what crosses to the engine being plain values.

The staged transport runs for real on CPU (``shm``: a shared-memory staging buffer, the CPU
twin of ``cuda_ipc``, same sender and receiver code); the receiver is vLLM-free here and loads
like vLLM 0.33's layer-wise reload (``model_executor/model_loader/reload/layerwise.py:185``
keeps a layer's tensors as given, ``:217-218`` reads them when the layer's last one arrived)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from nemo_d3s.backends import refit as R
from nemo_d3s.backends import staging as S
from nemo_d3s.distributed import run_on_gloo_ranks
from _limits import WAIT_S  # noqa: E402

BUCKET = 2000  # bytes: smaller than one "layer" below (3 x 768 B), larger than each tensor


def _weights(seed: int = 0):
    """Three "layers" of three [24, 8] fp32 tensors (768 B each: a layer spans two buckets),
    a norm, and one [64, 16] tensor larger than a bucket (4096 B: a bucket of its own)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {f"l{i}.{p}": (24, 8) for i in range(3) for p in ("gate", "up", "down")}
    shapes.update({"norm.w": (3,), "head.w": (64, 16)})
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _layer(name: str) -> str:
    return name.rsplit(".", 1)[0]


class LayerwiseSink:
    """An engine that loads like vLLM's layer-wise reload: it keeps what it is given for a
    layer until all the layer's tensors have arrived, and only then reads them (a view into a
    refilled buffer would be read too late). ``reader``: the worker's receiver."""

    def __init__(self, names, reader=None):
        self.layers = {}
        for n in names:
            self.layers.setdefault(_layer(n), set()).add(n)
        self.reader = reader or S.StagedBucketReader(torch.device("cpu"), S.shm_key(0))
        self.calls, self.loaded, self.handles = [], {}, []

    def begin_refit(self):
        self.calls.append("begin")
        self.pending = {}

    def _give(self, name, t):
        kept = self.pending.setdefault(_layer(name), {})
        kept[name] = t  # kept as given, like layerwise.py:185
        if set(kept) == self.layers[_layer(name)]:  # the layer's last tensor: read them all now
            self.loaded.update({n: v.clone() for n, v in kept.items()})
            del self.pending[_layer(name)]

    def load_tensors(self, meta, tensors):
        for m, t in zip(meta, tensors):
            self._give(m[0], t)

    def load_staged_bucket(self, meta, handles):
        pickle.dumps((meta, handles))  # plain: what vLLM's RPC must carry
        self.calls.append(sorted(handles))
        self.handles.append({k: tuple(v) for k, v in handles.items()})
        for n, t in self.reader.read(meta, handles):
            self._give(n, t)

    def end_refit(self):
        assert not self.pending, f"layers never completed: {sorted(self.pending)}"
        self.reader.close()
        self.calls.append("end")


class ViewKeepingReader(S.StagedBucketReader):
    """The receiver as it was before the fix: views into the sender's buffer, no copy."""

    def read(self, meta, handles):
        ((owner, handle),) = handles.items()
        handle = tuple(handle)
        if self._open is None or self._open[0] != handle:
            self._open = (handle, self._map(owner, handle))
        return S.tensors_from_buffer(meta, self._open[1])


def test_layers_split_over_buckets_of_one_reused_buffer_arrive_bit_for_bit():
    w = _weights()
    sink = LayerwiseSink(w)
    stats = R.WeightRefit(sink, transport="shm", bucket_bytes=BUCKET).push(iter(w.items()))
    assert sink.calls[0] == "begin" and sink.calls[-1] == "end"
    assert stats.buckets >= 5 and stats.max_bucket_bytes == 4096  # head.w alone
    assert stats.total_bytes == sum(t.numel() * 4 for t in w.values())
    # every layer of three spans two buckets: the case the layer-wise reload keeps tensors for
    buckets = [{_layer(m[0]) for m in b.meta} for b in R.iter_buckets(iter(w.items()), BUCKET)]
    assert {L for L in ("l0", "l1", "l2") if sum(L in b for b in buckets) > 1}
    # ONE staging buffer for the whole refit (grown once for the tensor larger than a bucket),
    # the same handle in every bucket of it, and its file gone from /dev/shm afterwards
    assert stats.staging_allocations == 2
    paths = {h[S.shm_key(0)][1] for h in sink.handles}
    assert len(paths) == 2 and len(sink.handles) == stats.buckets
    assert not any(os.path.exists(p) for p in paths)
    assert sink.loaded.keys() == w.keys()
    for n, t in w.items():
        assert torch.equal(sink.loaded[n], t), n


def test_a_receiver_keeping_views_into_the_refilled_buffer_loads_the_wrong_bytes():
    """Why the receiver copies: with views (the code before the fix) a layer split over two
    buckets is read after the next bucket overwrote its first part."""
    w = _weights()
    sink = LayerwiseSink(w, reader=ViewKeepingReader(torch.device("cpu"), S.shm_key(0)))
    R.WeightRefit(sink, transport="shm", bucket_bytes=BUCKET).push(iter(w.items()))
    wrong = sorted(n for n, t in w.items() if not torch.equal(sink.loaded[n], t))
    assert wrong and set(wrong) <= {n for n in w if _layer(n) in ("l0", "l1", "l2")}


def test_direct_hands_the_tensors_over_and_casts_first():
    w = _weights()
    sink = LayerwiseSink(w)
    R.WeightRefit(sink, transport="direct", bucket_bytes=BUCKET, dtype=torch.bfloat16).push(
        iter(w.items())
    )
    assert all(
        sink.loaded[n].dtype == torch.bfloat16 and torch.equal(sink.loaded[n], t.bfloat16())
        for n, t in w.items()
    )


def test_iter_buckets_keeps_order_and_offsets():
    w = _weights()
    buckets = list(R.iter_buckets(iter(w.items()), BUCKET))
    assert [m[0] for b in buckets for m in b.meta] == list(w)
    for b in buckets:
        assert [m[3] for m in b.meta] == [
            sum(t.numel() * 4 for t in b.tensors[:i]) for i in range(len(b.tensors))
        ]
        assert b.nbytes == sum(t.numel() * 4 for t in b.tensors)
        assert b.nbytes <= BUCKET or len(b.tensors) == 1


def test_reader_refuses_a_bucket_with_no_buffer_for_its_worker():
    reader = S.StagedBucketReader(torch.device("cpu"), S.shm_key(2))
    with pytest.raises(RuntimeError, match="no staging buffer for this worker"):
        reader.read([("x", "float32", [1], 0)], {S.shm_key(0): ("shm", "/x", 4), "h:1": ()})


def _rank_body(rank: int, hosts: list):
    import torch.distributed as dist

    group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    w = _weights()
    sink = LayerwiseSink(w) if rank == 0 else None
    stats = R.WeightRefit(
        sink,
        transport="shm",
        group=group,
        src=0,
        hosts_engine_gpu=hosts[rank],
        bucket_bytes=BUCKET,
    ).push(iter(w.items()))
    out = {"staged_bytes": stats.staged_bytes, "allocations": stats.staging_allocations}
    if rank == 0:
        out["calls"] = [c if isinstance(c, str) else ",".join(c) for c in sink.calls]
        out["equal"] = sink.loaded.keys() == w.keys() and all(
            torch.equal(sink.loaded[n], t) for n, t in w.items()
        )
    return out


@pytest.mark.distributed
def test_staged_protocol_gathers_the_engine_workers_handles_and_other_ranks_stage_nothing():
    """3 ranks of one model copy; the engine (on rank 0) has two workers, ranks 0 and 1 stage
    for them (their GPUs; here their shared-memory slots); rank 2 (another stage's GPU) only
    serves the source: it stages nothing."""
    r0, r1, r2 = run_on_gloo_ranks(_rank_body, 3, [True, True, False], timeout=WAIT_S)
    assert r0["equal"]
    buckets = [c for c in r0["calls"] if c not in ("begin", "end")]
    assert r0["calls"][0] == "begin" and r0["calls"][-1] == "end" and len(buckets) >= 5
    assert all(c == f"{S.shm_key(0)},{S.shm_key(1)}" for c in buckets)  # none from rank 2
    assert r1["staged_bytes"] == r0["staged_bytes"] > 0 and r1["allocations"] == 2
    assert r2["staged_bytes"] == 0 and r2["allocations"] == 0


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

    class Sink(LayerwiseSink):
        def begin_refit(self):
            super().begin_refit()
            order.append("wake")

    w = _weights()
    R.WeightRefit(Sink(w), transport="shm", device=torch.device("cuda", 1)).push(iter(w.items()))
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
    plain = S.plain_ipc_handle(args)
    allowed = (int, bool, bytes, str, list, type(None))
    assert all(isinstance(x, allowed) for x in plain)
    assert plain[0] == [4096] and plain[3] == "uint8" and plain[4] == 3
    assert pickle.loads(pickle.dumps(plain)) == plain


def _failing_rank_body(rank: int):
    import torch.distributed as dist

    group = dist.new_group([0, 1], backend="gloo")
    w = _weights()

    class Refuses(LayerwiseSink):
        def load_staged_bucket(self, meta, handles):
            if len(self.handles) == 2:
                raise OSError("the engine died")
            super().load_staged_bucket(meta, handles)

    sink = Refuses(w) if rank == 0 else None
    try:
        R.WeightRefit(sink, transport="shm", group=group, src=0, bucket_bytes=BUCKET).push(
            iter(w.items())
        )
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    else:
        error = None
    dist.barrier(group=group)  # both ranks are at the same collective afterwards
    return error


@pytest.mark.distributed
def test_a_failure_on_the_engines_rank_raises_on_every_rank_of_the_refit():
    """The engine's rank fails at its third bucket: it raises its error and the other rank
    raises too, at the same point (it used to wait in the next barrier until the group's
    timeout, paired with whatever collective the failed rank ran next)."""
    r0, r1 = run_on_gloo_ranks(_failing_rank_body, 2, timeout=WAIT_S)
    assert r0 == "OSError: the engine died"
    assert r1.startswith("RuntimeError: refit failed on another rank of the group")
