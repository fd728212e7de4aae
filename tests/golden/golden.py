"""Golden metrics: per-step metrics of short runs at the layouts the tests use, committed as
text (``tests/golden/<layout>.jsonl``), so that a change that moves numbers is caught
(torchtitan keeps golden loss curves the same way).

Layouts (the same tiny Llama folder, the same 3-step D3S smoke run):

==========  =====  ===================================================
name        ranks  backend / layout
==========  =====  ===================================================
single      1      HF backend, one process (the CPU default's path)
dp2         2      HF backend, torchrun, data parallel
packed      1      HF backend, one process, packed sequences
dp2_packed  2      HF backend, torchrun, data parallel, packed sequences
tp2         2      Megatron backend, TP2 (gloo)
tp2_pp2     4      Megatron backend, TP2 x PP2 (gloo)
tp2_packed  2      Megatron backend, TP2, packed sequences (THD, the local attention)
cp2         2      Megatron backend, context parallel 2 (K/V gathered over CP)
ep2         2      Megatron backend, DP 2 x EP 2 (the tiny Qwen3-MoE, all-to-all)
==========  =====  ===================================================

The model is a tiny random Llama (``ep2``: a tiny random Qwen3-MoE, 4 experts, top-2) whose
every tensor is drawn here from a generator seeded by the tensor's name, so the golden numbers
do not depend on transformers' initialiser (which may change between releases) or on the
module order.

Regenerate after a change that is MEANT to move numbers (say so in the commit)::

    python tests/golden/golden.py --write            # all layouts
    python tests/golden/golden.py --write single dp2 # some

Comparison (:func:`compare`): every key the golden row holds must be in the fresh row;
integers (rewards are counts of correct answers over samples, kept counts, token counts)
exactly, floats to rel 1e-4 (the layouts sum gradients in different orders; a different
CPU's BLAS may too: observed drift < 1e-6 relative). Timing keys and the DP load-balance
keys (which differ between layouts by design) are not stored.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Dict, List, Sequence

# tests/ holds _limits: on the path under pytest, not when this file runs as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _limits import WAIT_S  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

RUN = [
    "experiment=smoke",
    "trainer.steps=3",
    "trainer.eval_every=0",
    "trainer.eval_at_start=false",
    "trainer.save_every=0",
    "trainer.export_hf=false",
    "trainer.max_new_tokens=12",
    "task.eval_size=4",
    "~model.params.tiny",
]


def _megatron(tp: int, pp: int) -> List[str]:
    return [
        "model.backend=megatron",
        f"+model.params.tensor_model_parallel_size={tp}",
        f"+model.params.pipeline_model_parallel_size={pp}",
    ]


# name -> (ranks, extra overrides)
LAYOUTS: Dict[str, tuple] = {
    "single": (1, []),
    "dp2": (2, []),
    "packed": (1, ["trainer.pack_sequences=true"]),
    "dp2_packed": (2, ["trainer.pack_sequences=true"]),
    "tp2": (2, _megatron(2, 1)),
    "tp2_pp2": (4, _megatron(2, 2)),
    "tp2_packed": (2, [*_megatron(2, 1), "trainer.pack_sequences=true"]),
    "cp2": (2, [*_megatron(1, 1), "+model.params.context_parallel_size=2"]),
    "ep2": (2, [*_megatron(1, 1), "+model.params.expert_model_parallel_size=2"]),
}
# layouts of the mixture-of-experts model (make_model(..., moe=True)); the rest: the Llama
MOE_LAYOUTS = {"ep2"}
# Differ between layouts by design (how the DP ranks' loads were balanced).
LAYOUT_KEYS = {"dp_imbalance_before", "dp_imbalance_after"}
REL, ABS = 1e-4, 1e-6


def make_model(folder: Path, moe: bool = False) -> Path:
    """A tiny Llama (vocab 300, hidden 32, 4 layers, 4 heads / 2 kv heads, untied) with the
    byte-level tokenizer; ``moe``: a Qwen3-MoE of the same sizes (head_dim 8, 4 experts of
    width 24, top-2, renormalised). Weights ~ N(0, 0.2), norms ~ 1 + N(0, 0.1), each tensor
    from a generator seeded by crc32 of its name."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from nemo_d3s.backends.hf.loading import byte_level_tokenizer

    folder = Path(folder)
    tok = byte_level_tokenizer()
    config, cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (LlamaConfig, LlamaForCausalLM)
    extra = dict(
        head_dim=8,
        moe_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        use_sliding_window=False,
    )
    cfg = config(
        **(extra if moe else {}),
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    model = cls(cfg)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    # the names and shapes the checkpoint holds (transformers 5 keeps a MoE's experts fused
    # in memory and writes them one tensor per expert)
    saved = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as shard:
            saved.update({k: shard.get_tensor(k) for k in shard.keys()})
    tensors = {}
    for name, p in sorted(saved.items()):
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        tensors[name] = (
            (1.0 + 0.1 * noise if "norm" in name else 0.2 * noise).to(p.dtype).contiguous()
        )
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_layout(name: str, model: Path, out: Path, timeout: float = WAIT_S) -> List[dict]:
    """Run the golden smoke run at layout ``name``; its metric rows, without timing keys."""
    from nemo_d3s.trainer.metrics import is_timing_key, read_jsonl

    ranks, extra = LAYOUTS[name]
    overrides = [*RUN, f"model.name={model}", *extra, f"output_dir={out}"]
    launcher = (
        [sys.executable, "-m", "nemo_d3s.train"]
        if ranks == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            "-m",
            "nemo_d3s.train",
        ]
    )
    r = subprocess.run(
        [*launcher, *overrides],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if r.returncode != 0:
        raise RuntimeError(
            f"golden run {name} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}"
        )
    return [
        {k: v for k, v in row.items() if not is_timing_key(k) and k not in LAYOUT_KEYS}
        for row in read_jsonl(Path(out) / "metrics.jsonl")
    ]


def golden_path(name: str) -> Path:
    return HERE / f"{name}.jsonl"


def read_golden(name: str) -> List[dict]:
    return [json.loads(line) for line in golden_path(name).read_text().splitlines() if line.strip()]


def compare(golden: Sequence[dict], fresh: Sequence[dict], what: str) -> List[str]:
    """Differences of ``fresh`` from ``golden`` (empty = same run), one line each."""
    diffs: List[str] = []
    if len(golden) != len(fresh):
        return [f"{what}: {len(fresh)} steps, golden has {len(golden)}"]
    for g, f in zip(golden, fresh):
        step = g.get("step")
        for key, want in g.items():
            if key not in f:
                diffs.append(f"{what} step {step}: metric {key!r} missing")
                continue
            got = f[key]
            exact = not (
                isinstance(want, float)
                and not want.is_integer()
                or isinstance(got, float)
                and not float(got).is_integer()
            )
            if (
                exact
                and got != want
                or not exact
                and not math.isclose(got, want, rel_tol=REL, abs_tol=ABS)
            ):
                diffs.append(f"{what} step {step}: {key} = {got!r}, golden {want!r}")
    return diffs


def write(names: Sequence[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        models = {moe: make_model(Path(tmp) / f"model{int(moe)}", moe) for moe in (False, True)}
        for name in names:
            rows = run_layout(name, models[name in MOE_LAYOUTS], Path(tmp) / name)
            golden_path(name).write_text(
                "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
            )
            print(f"wrote {golden_path(name)} ({len(rows)} steps)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--write", action="store_true", help="run the layouts and overwrite their golden files"
    )
    ap.add_argument(
        "layouts", nargs="*", default=list(LAYOUTS), help=f"any of {', '.join(LAYOUTS)}"
    )
    args = ap.parse_args(argv)
    unknown = [n for n in args.layouts if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; known: {', '.join(LAYOUTS)}")
    if not args.write:
        ap.error(
            "nothing to do: pass --write to regenerate (the test compares: pytest tests/golden)"
        )
    write(args.layouts)


if __name__ == "__main__":
    main()
