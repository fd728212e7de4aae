"""benchmarks/bench_entropy_cuda.py's two methods, on the CPU: the plain fp32 log_softmax and
the project's chunked kernel agree (the record's agreement is this, at 16k x 152k on a GPU),
hand-checked on a uniform row; without CUDA the script says so and exits 2."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_entropy_cuda.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_entropy_cuda", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_two_methods_agree_and_a_uniform_row_has_entropy_log_v():
    bench = _bench()
    g = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(2, 5, 37, generator=g)
    logits[0, 0] = 0.0  # uniform: entropy log(37), every log-prob -log(37)
    targets = torch.randint(0, 37, (2, 5), generator=g)
    e1, l1 = bench.chunked(logits, targets, chunk_size=3)
    e2, l2 = bench.plain(logits, targets)
    torch.testing.assert_close(e1, e2, rtol=0, atol=1e-5)
    torch.testing.assert_close(l1, l2, rtol=0, atol=1e-5)
    assert math.isclose(float(e2[0, 0]), math.log(37), rel_tol=1e-6)
    assert math.isclose(float(l2[0, 0]), -math.log(37), rel_tol=1e-6)


def test_without_cuda_it_exits_2(tmp_path, monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs CUDA" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
