"""Checkpoint checksums spread over the ranks (issue 30, item 2).

A 70B checkpoint with its optimizer state is ~1 TB. When rank 0 alone hashed every file the
other ranks waited on a barrier longer than the collective timeout. Here, on 4 gloo ranks,
hashing is slowed (``files.sha256_file`` patched to sleep ``SLOW_S`` per file) and the
world group's timeout is cut to ``TIMEOUT_S``: one rank hashing all 14 files needs 14 s,
longer than the timeout; each rank's own share needs at most 5 s. The tests read which
files each rank hashed: its own when saving (rank 0 also the files nobody named), its
share of ``formats.checksums.checksum_shares`` when verifying; and a corrupt file in ANY
rank's share makes every rank report the same problem and raise the same error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_d3s.distributed import run_on_gloo_ranks
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD, SLOW_S, TIMEOUT_S = 4, 1.0, 10.0


class _ShardedPolicy:
    """A policy that writes its own files (as the Megatron backend does): two shard files
    per rank of different sizes, returned as this rank's; rank 0 also writes config.json,
    which it does not name (the Megatron backend's tokenizer files are such)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.loaded = rank, None

    def save_checkpoint(self, folder: str):
        d = Path(folder) / "shards"
        d.mkdir(exist_ok=True)
        names = []
        for i in range(2):
            f = d / f"rank{self.rank}_{i}.bin"
            f.write_bytes(bytes([self.rank, i]) * (500 * (self.rank + 1) * (i + 1)))
            names.append(f"shards/{f.name}")
        if self.rank == 0:
            (Path(folder) / "config.json").write_text("{}")
        return names

    def load_checkpoint(self, folder: str) -> bool:
        self.loaded = Path(folder).name
        return True


def _rel(path) -> str:
    """``path`` relative to its checkpoint folder (``step_*`` or ``.tmp_step_*``)."""
    parts = Path(path).parts
    at = max(i for i, p in enumerate(parts) if "step_" in p)
    return "/".join(parts[at + 1 :])


def _setup(rank: int, slow: bool):
    """Patch the hash to record (and, when ``slow``, to sleep), cut the world's timeout."""
    import datetime
    import time

    import torch.distributed as dist

    from nemo_d3s import files

    hashed: list = []
    real = files.sha256_file

    def recording(path, chunk=1 << 20):
        hashed.append(_rel(path))
        if slow:
            time.sleep(SLOW_S)
        return real(path, chunk)

    files.sha256_file = recording
    dist.barrier()  # every rank is up before the short timeout applies
    # torch 2.13 distributed_c10d.py:1616 (_set_pg_timeout): the gloo backend's default timeout
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=TIMEOUT_S), dist.group.WORLD)
    return hashed


def _groups(rank: int):
    import torch.distributed as dist

    from nemo_d3s.distributed.groups import ParallelGroups

    return ParallelGroups(dp=dist.group.WORLD, global_rank=rank)


def _slow_save_and_resume(rank: int, out: str):
    from nemo_d3s.formats.checksums import checksum_entries, checksum_shares
    from nemo_d3s.trainer.checkpoint import CheckpointManager, TrainerState

    hashed = _setup(rank, slow=True)
    policy = _ShardedPolicy(rank)
    mgr = CheckpointManager(out, _groups(rank), keep_last=2)
    final = mgr.save(policy, TrainerState(step=3))
    saved = sorted(hashed)
    hashed.clear()
    found = mgr.load_latest(policy)
    entries, _ = checksum_entries(final)
    share = [e[0] for e in checksum_shares(entries, WORLD)[rank]]
    return {
        "saved": saved,
        "verified": sorted(hashed),
        "share": share,
        "listed": sorted(e[0] for e in entries),
        "step": found[1].step,
        "loaded": policy.loaded,
    }


def test_each_rank_hashes_its_own_files_and_its_share_within_the_timeout(tmp_path):
    res = run_on_gloo_ranks(_slow_save_and_resume, WORLD, str(tmp_path), timeout=WAIT_S)
    listed = res[0]["listed"]
    assert len(listed) == 14  # 8 shards + 4 rng + trainer_state.json + config.json
    for r, x in enumerate(res):
        own = [f"rng_rank{r}.pt", f"shards/rank{r}_0.bin", f"shards/rank{r}_1.bin"]
        if r == 0:
            own += ["config.json", "trainer_state.json"]
        assert x["saved"] == sorted(own), r
        assert x["verified"] == x["share"], r
        assert x["step"] == 3 and x["loaded"] == "step_000003"
    shares = [f for x in res for f in x["share"]]
    assert sorted(shares) == listed  # the shares cover every file, each once


def _corrupt_each_share(rank: int, out: str):
    import torch.distributed as dist

    from nemo_d3s.errors import RunError
    from nemo_d3s.formats.checksums import checksum_entries, checksum_shares
    from nemo_d3s.trainer.checkpoint import CheckpointManager, TrainerState, verify_checkpoint

    hashed = _setup(rank, slow=False)
    policy = _ShardedPolicy(rank)
    mgr = CheckpointManager(out, _groups(rank), keep_last=2)
    final = mgr.save(policy, TrainerState(step=1))
    shares = checksum_shares(checksum_entries(final)[0], WORLD)
    found, reads = [], []
    for target in range(WORLD):
        # a shard file only rank ``target`` reads (a flipped bit in trainer_state.json
        # would be found garbled before any hashing)
        bad = next(e[0] for e in shares[target] if e[0].startswith("shards/"))
        if rank == 0:
            data = bytearray((final / bad).read_bytes())
            data[0] ^= 0x01
            (final / bad).write_bytes(bytes(data))
        dist.barrier()
        hashed.clear()
        found.append([bad, verify_checkpoint(final, shared=True)])
        reads.append(sorted(hashed))
        dist.barrier()
        if rank == 0:
            data[0] ^= 0x01
            (final / bad).write_bytes(bytes(data))
        dist.barrier()
    bad = next(e[0] for e in shares[WORLD - 1] if e[0].startswith("shards/"))
    if rank == 0:
        (final / bad).write_bytes(b"")
    dist.barrier()
    try:
        mgr.load_latest(policy)
        error = None
    except RunError as e:
        error = str(e)
    return {"found": found, "reads": reads, "error": error, "bad": bad}


def test_a_corrupt_file_in_any_ranks_share_gives_every_rank_the_same_error(tmp_path):
    res = run_on_gloo_ranks(_corrupt_each_share, WORLD, str(tmp_path), timeout=WAIT_S)
    for target in range(WORLD):
        bad, msg = res[0]["found"][target]
        assert msg == f"{bad} does not match its SHA-256 checksum (corrupt)", target
        assert all(x["found"][target] == [bad, msg] for x in res)
        # only rank ``target`` read the corrupt file
        assert [bad in x["reads"][target] for x in res] == [r == target for r in range(WORLD)]
    err = res[0]["error"]
    assert err is not None and f"step_000001: {res[0]['bad']} has 0 bytes" in err
    assert all(x["error"] == err for x in res)


def _rank0_cannot_create_the_folder(rank: int, out: str):
    import errno

    from nemo_d3s.errors import RunError
    from nemo_d3s.trainer.checkpoint import CheckpointManager, TrainerState

    _setup(rank, slow=False)  # the world's short timeout: a mismatched collective fails fast
    mgr = CheckpointManager(out, _groups(rank), keep_last=2)
    if rank == 0:
        (Path(out) / "checkpoints").mkdir(parents=True)
        real = Path.mkdir

        def full(self, *a, **kw):
            if self.name.startswith(".tmp_step_"):
                raise OSError(errno.ENOSPC, "No space left on device", str(self))
            return real(self, *a, **kw)

        Path.mkdir = full
    try:
        mgr.save(_ShardedPolicy(rank), TrainerState(step=1))
    except RunError as e:
        return str(e)
    return "saved"


def test_rank_0_failing_to_create_the_folder_is_one_clear_error_on_every_rank(tmp_path):
    """Rank 0's rmtree / mkdir failed before the barrier the others waited in: it went on to
    the digests' all-gather, so the ranks met in different collectives (a wait until the
    timeout, or gloo pairing a barrier with a gather). Now every rank learns of it first."""
    res = run_on_gloo_ranks(_rank0_cannot_create_the_folder, WORLD, str(tmp_path), timeout=WAIT_S)
    for r, msg in enumerate(res):
        assert msg.startswith("could not write checkpoint step_000001"), (r, msg)
        assert "No space left on device" in msg, (r, msg)
    assert not list((tmp_path / "checkpoints").iterdir())


def _fsynced_files(rank: int, out: str):
    from nemo_d3s import files_staging
    from nemo_d3s.trainer import checkpoint as ckpt_mod

    _setup(rank, slow=False)
    flushed, tree, real = [], [], ckpt_mod.fsync_path

    def recording(into):
        def fsync(path, *, folder):
            if not folder:
                into.append(_rel(path))
            return real(path, folder=folder)

        return fsync

    ckpt_mod.fsync_path = recording(flushed)  # each rank's own files
    files_staging.fsync_path = recording(tree)  # rank 0's pass over the folder before the rename
    mgr = ckpt_mod.CheckpointManager(out, _groups(rank), keep_last=2)
    mgr.save(_ShardedPolicy(rank), ckpt_mod.TrainerState(step=1))
    return sorted(flushed), sorted(tree)


def test_each_rank_flushes_the_files_it_wrote_before_the_checkpoint_is_published(tmp_path):
    """Only rank 0 flushed the folder (fsync_tree) before the rename that publishes it; on a
    parallel filesystem that does not reach the pages another node's client holds, so a
    crash of that node after the rename left a published checkpoint failing its checksums."""
    res = run_on_gloo_ranks(_fsynced_files, WORLD, str(tmp_path), timeout=WAIT_S)
    for r, (flushed, tree) in enumerate(res):
        own = [f"rng_rank{r}.pt", f"shards/rank{r}_0.bin", f"shards/rank{r}_1.bin"]
        if r == 0:
            own += ["trainer_state.json"]
        assert flushed == sorted(own), (r, flushed)
        # rank 0 then flushes what nobody named (the policy's config.json, the checksums
        # written last), not again every file its writer flushed
        assert tree == (["checksums.json", "config.json"] if r == 0 else []), (r, tree)
