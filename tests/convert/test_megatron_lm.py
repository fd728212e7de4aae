"""Megatron-LM / Megatron-Bridge checkpoints (megatron-core ``dist_checkpointing``, torch_dist),
with megatron-core itself as the judge, on gloo ranks:

- a checkpoint written the way Megatron-LM writes one (``dist_checkpointing.save`` of
  ``{"model": GPTModel.sharded_state_dict(), "args": Namespace, "iteration", ...}`` from every
  rank, ``iter_0000007/`` + ``latest_checkpointed_iteration.txt``) at TP1 (a GQA Llama, the
  model described by its args) and the way Megatron-Bridge writes one at TP2 x PP2 (a tied
  Qwen3 with q/k norms, described by ``run_config.yaml``, tokenizer in ``tokenizer/``) converts
  to HF bit-exactly; ``ModelSpec.from_folder`` reads the model the checkpoint describes;
- that HF folder converted back (``hf-to-megatron-lm``) loads with megatron-core's own
  ``dist_checkpointing.load`` into a real GPTModel's ``sharded_state_dict`` at TP1 and at
  TP2 x PP2: every parameter bit-exact (vocabulary padding rows included);
- ``model.name=<save folder>`` starts the Megatron backend (TP2), scoring as transformers does;
- bad input: a common.pt whose pickle would run code is refused (and not run), a tracker that
  names nothing, a Megatron-LM checkpoint without vocab_size or tokenizer asks for --hf-config.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _models import assert_same_tensors, hf_tensors, megatron_lm_args_for, tiny  # noqa: E402
from _launch import run_ranks  # noqa: E402

from nemo_d3s.convert import megatron_to_hf  # noqa: E402
from nemo_d3s.convert.mcore import hf_to_megatron_lm  # noqa: E402
from nemo_d3s.errors import ConfigError  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed


def _backend(folder, tp, pp):
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    return MegatronBackend(
        MegatronBackendConfig(
            model=folder,
            device="cpu",
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
        )
    )


def _rank_save(rank, folder, iter_dir, args):
    """Every rank: megatron-core's own sharded_state_dict of its stage, saved with
    dist_checkpointing.save as Megatron-LM's save_checkpoint nests it."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron.nemo2_writer import _TorchOnCpu

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    pol = _backend(folder, tp, pp)
    state = {"model": pol.model.sharded_state_dict(), "iteration": 7, "checkpoint_version": 3.0}
    if args is not None:
        state["args"] = args
    with _TorchOnCpu():
        dist_checkpointing.save(state, iter_dir)


def _rank_load(rank, folder, iter_dir):
    """Every rank: megatron-core's dist_checkpointing.load of the checkpoint into its stage's
    sharded_state_dict; returns which parameters differ from the backend's own load of the
    HF folder (expected: none) and how many were compared."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron.nemo2_writer import _TorchOnCpu

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    pol = _backend(folder, tp, pp)
    want = {n: p.detach().clone() for n, p in pol.model.named_parameters()}
    with torch.no_grad():
        for p in pol.model.parameters():
            p.zero_()
    with _TorchOnCpu():
        loaded = dist_checkpointing.load({"model": pol.model.sharded_state_dict()}, iter_dir)
    got = loaded["model"]
    bad = [n for n, t in want.items() if not torch.equal(got[n], t)]
    return bad, len(want)


def _save_folder(tmp_path, src, tp, pp, *, bridge):
    """A save folder as Megatron-LM (args in common.pt) or Megatron-Bridge (run_config.yaml,
    tokenizer/) writes it, at TP x PP."""
    import json

    import yaml

    save = tmp_path / "save"
    it = save / "iter_0000007"
    it.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    padded = 128 * tp * -(-cfg["vocab_size"] // (128 * tp))
    args = None if bridge else megatron_lm_args_for(cfg, tp, pp, padded)
    run_ranks(_rank_save, tp * pp, str(src), str(it), args, tp=tp, pp=pp, timeout=WAIT_S)
    if bridge:  # what Megatron-Bridge adds: the provider's fields, the tokenizer assets
        model = {
            "_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider",
            "num_layers": cfg["num_hidden_layers"],
            "hidden_size": cfg["hidden_size"],
            "ffn_hidden_size": cfg["intermediate_size"],
            "num_attention_heads": cfg["num_attention_heads"],
            "num_query_groups": cfg["num_key_value_heads"],
            "kv_channels": cfg["head_dim"],
            "layernorm_epsilon": cfg["rms_norm_eps"],
            "normalization": "RMSNorm",
            "gated_linear_unit": True,
            "add_bias_linear": False,
            "add_qkv_bias": False,
            "qk_layernorm": True,
            "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False},
            "position_embedding_type": "rope",
            "rotary_base": 10000,
            "seq_length": cfg["max_position_embeddings"],
            "vocab_size": cfg["vocab_size"],
            "share_embeddings_and_output_weights": cfg["tie_word_embeddings"],
            "params_dtype": {"_target_": "torch.float32", "_call_": False},
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "hf_model_id": "Qwen/Qwen3-0.6B",
        }
        checkpoint = {"save_optim": True, "save_rng": True, "fully_parallel_save": True}
        (it / "run_config.yaml").write_text(
            yaml.safe_dump({"model": model, "checkpoint": checkpoint})
        )
        (it / "tokenizer").mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copyfile(src / name, it / "tokenizer" / name)
    (save / "latest_checkpointed_iteration.txt").write_text("7")
    return save


CASES = {
    "megatron_lm_llama_tp1": ("llama", 1, 1, False),
    "megatron_bridge_qwen3_tp2pp2": ("qwen3", 2, 2, True),
}


@pytest.mark.slow  # a multi-rank equality run of 20-60 s: the slow tier (docs/ci.md)
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_core_is_the_judge(case, tmp_path):
    from nemo_d3s.formats.detect import MEGATRON_LM, detect_format
    from nemo_d3s.formats.spec import ModelSpec

    arch, tp, pp, bridge = CASES[case]
    src = tiny(tmp_path / "src", arch)
    save = _save_folder(tmp_path, src, tp, pp, bridge=bridge)
    assert detect_format(save).kind == detect_format(save / "iter_0000007").kind == MEGATRON_LM
    # the model the checkpoint describes (args / run_config.yaml) is the HF config's
    mine, theirs = ModelSpec.from_folder(save).to_dict(), ModelSpec.from_folder(src).to_dict()
    for key in mine:
        if key not in ("architecture", "model_type", "torch_dtype", "max_position_embeddings"):
            assert mine[key] == theirs[key], key
    # -> HF, bit-exact (Megatron-LM keeps no tokenizer: --hf-config gives it)
    back = megatron_to_hf(
        save, tmp_path / "back", hf_config=None if bridge else src, progress=False
    )
    assert_same_tensors(src, back)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(back)).config.vocab_size == 300
    # -> Megatron-LM again, loaded by megatron-core into a real GPTModel at TP1 / TP2 x PP2
    lt, lp = (1, 1) if tp == 1 else (2, 2)
    out = hf_to_megatron_lm(back, tmp_path / "again", tp=lt, progress=False)
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    results = run_ranks(
        _rank_load, lt * lp, str(src), str(out / "release"), tp=lt, pp=lp, timeout=WAIT_S
    )
    for bad, compared in results:
        assert compared > 0 and bad == [], bad


def _rank_scores(rank, folder):
    from nemo_d3s.backends.base import TokenBatch

    pol = _backend(folder, 2, 1)
    ids = torch.tensor([[5, 70, 71, 72, 101, 33, 9, 250]])
    attn = torch.ones_like(ids, dtype=torch.bool)
    return pol.score(TokenBatch(ids, attn, attn), with_entropy=False).logprobs, ids


def test_a_save_folder_starts_the_backend(tmp_path):
    """model.name=<a Megatron-LM / Megatron-Bridge save folder> at TP2 scores as
    transformers does on the model it came from (a tied Qwen3 written by hf-to-megatron-lm)."""
    from transformers import AutoModelForCausalLM

    from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs

    src = tiny(tmp_path / "src", "qwen3")
    save = hf_to_megatron_lm(src, tmp_path / "save", tp=2, progress=False)
    lp, ids = run_ranks(_rank_scores, 2, str(save), tp=2, pp=1, timeout=WAIT_S)[0]
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    want = align_to_tokens(entropy_and_logprobs(logits[:, :-1], ids[:, 1:])[1])
    assert float((lp - want).abs().max()) <= 1e-4


# ---------------------------------------------------------------------------- no GPU ranks
def test_written_folder_reads_from_args_alone_and_refuses_bad_input(tmp_path):
    """hf-to-megatron-lm's output round trips bit-exactly (bfloat16 Llama); without
    run_config.yaml the model comes from common.pt's args; without tokenizer/ --hf-config is
    asked for; a tracker naming nothing and a common.pt that would run code are refused."""
    import pickle
    import zipfile

    src = tiny(tmp_path / "src", "llama", "bfloat16")
    out = hf_to_megatron_lm(src, tmp_path / "mlm", progress=False)
    it = out / "release"
    assert sorted(os.listdir(out)) == [
        "checksums.json",
        "latest_checkpointed_iteration.txt",
        "release",
    ]
    assert_same_tensors(src, megatron_to_hf(out, tmp_path / "b1", progress=False))
    bare = shutil.copytree(out, tmp_path / "bare")
    (bare / "checksums.json").unlink()
    (bare / "release" / "run_config.yaml").unlink()
    from nemo_d3s.convert.sources import open_checkpoint

    src_info = open_checkpoint(bare)
    # megatron-core <= 0.18 writes common.pt, 0.19 the common_state item (mcore_config.py)
    legacy = (bare / "release" / "common.pt").is_file()
    assert ("common.pt" if legacy else ".metadata' common_state") in src_info.origin
    assert "(Megatron-LM) args" in src_info.origin
    shutil.rmtree(bare / "release" / "tokenizer")
    with pytest.raises(ConfigError, match="holds no tokenizer/.*--hf-config"):
        megatron_to_hf(bare, tmp_path / "b2", progress=False)
    assert_same_tensors(src, megatron_to_hf(bare, tmp_path / "b3", hf_config=src, progress=False))
    # a tracker naming an iteration that is not there
    (bare / "latest_checkpointed_iteration.txt").write_text("12")
    with pytest.raises(ConfigError, match="names .*iter_0000012.*not a torch_dist checkpoint"):
        megatron_to_hf(bare, tmp_path / "b4", hf_config=src, progress=False)
    # a common.pt whose pickle would run code: refused before any of it runs (read first
    # on either megatron-core version, as its own loader does)
    flag = tmp_path / "pwned"
    evil = shutil.copytree(it, tmp_path / "evil")
    shutil.rmtree(evil / "tokenizer")
    (evil / "run_config.yaml").unlink()

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    with zipfile.ZipFile(evil / "common.pt", "w") as z:
        z.writestr("common/data.pkl", pickle.dumps({"args": RunsCode()}, protocol=2))
    with pytest.raises(ConfigError, match="common.pt.*refusing to unpickle (posix|os).system"):
        megatron_to_hf(evil, tmp_path / "b5", progress=False)
    assert not flag.exists()
    assert sorted(os.listdir(tmp_path)) == ["b1", "b3", "bare", "evil", "mlm", "src"]
    assert hf_tensors(src)


def _dcp_common_state(folder, payload):
    """A torch_dist folder laid out as megatron-core 0.19 writes the common state: torch DCP's
    own save of one byte item ``common_state/shard_0_1`` holding ``payload`` (a torch.save
    zip), beside a model tensor; no common.pt (made with torch DCP, so it needs no
    megatron-core 0.19 and checks the same reader on either environment). The planner stores
    the bytes as given, as megatron-core's MCoreSavePlanner does (0.19.2
    strategies/torch.py:417-425 and :488-490); torch's default one would torch.save
    the BytesIO again (torch default_planner.py:283-289)."""
    import io
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class AsGiven(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            return object

    folder.mkdir(parents=True)
    state = {"common_state/shard_0_1": io.BytesIO(payload), "w": torch.arange(6.0)}
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(str(folder)),
        planner=AsGiven(),
        no_dist=True,
    )
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return folder


def test_common_state_as_megatron_core_019_stores_it(tmp_path):
    """megatron-core 0.19's layout (no common.pt: the state in a DCP byte item) is read
    through the same allow-list: args come back as a record; a pickle that would run code is
    refused without running; a folder with neither layout asks for --hf-config."""
    import io
    import pickle
    import zipfile

    from nemo_d3s.formats.detect import MEGATRON_LM, detect_format
    from nemo_d3s.formats.mcore_config import common_state, megatron_lm_args

    buf = io.BytesIO()
    args = argparse.Namespace(num_layers=3, vocab_size=300, params_dtype=torch.bfloat16)
    torch.save([{"args": args, "iteration": 7}], buf)
    good = _dcp_common_state(tmp_path / "good", buf.getvalue())
    assert not (good / "common.pt").exists() and detect_format(good).kind == MEGATRON_LM
    state, where = common_state(good)
    assert state["iteration"] == 7 and where.endswith(".metadata' common_state")
    got, _ = megatron_lm_args(good)
    assert got == {"num_layers": 3, "vocab_size": 300, "params_dtype": torch.bfloat16}
    # common.pt, when present, is what is read (megatron-core's own order)
    legacy = io.BytesIO()
    torch.save({"iteration": 9}, legacy)
    (good / "common.pt").write_bytes(legacy.getvalue())
    assert common_state(good)[0] == {"iteration": 9}

    flag = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    evil_zip = io.BytesIO()
    with zipfile.ZipFile(evil_zip, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps([{"args": RunsCode()}], protocol=2))
    evil = _dcp_common_state(tmp_path / "evil", evil_zip.getvalue())
    with pytest.raises(ConfigError, match="common_state.*refusing to unpickle (posix|os).system"):
        common_state(evil)
    assert not flag.exists()
    # neither layout (the item renamed in place: same length, the pickle stays valid)
    empty = shutil.copytree(good, tmp_path / "empty")
    (empty / "common.pt").unlink()
    torch_meta = empty / ".metadata"
    torch_meta.write_bytes(torch_meta.read_bytes().replace(b"common_state", b"other_state!"))
    with pytest.raises(ConfigError, match="neither common.pt .* nor .*--hf-config"):
        common_state(empty)


def test_the_command_line_both_ways(tmp_path, capsys):
    """nemo-d3s-convert hf-to-megatron-lm, then megatron-to-hf on the save folder: exit 0,
    bit-exact, and the second says where the architecture came from."""
    from nemo_d3s.convert.__main__ import main

    src = tiny(tmp_path / "src", "qwen3")
    assert (
        main(["hf-to-megatron-lm", "--hf", str(src), "--out", str(tmp_path / "m"), "--quiet"]) == 0
    )
    assert (
        main(["megatron-to-hf", "--ckpt", str(tmp_path / "m"), "--out", str(tmp_path / "h")]) == 0
    )
    err = capsys.readouterr().err
    assert "architecture from" in err and "run_config.yaml' (Megatron-Bridge) model" in err
    assert_same_tensors(src, tmp_path / "h")


def test_a_tp_that_does_not_divide_the_heads_is_refused_before_writing(tmp_path, capsys):
    """--tp 3 on a model with 4 heads wrote a save folder no Megatron-LM run could load."""
    import json

    from nemo_d3s.convert.__main__ import main

    src = tiny(tmp_path / "src", "llama")
    heads = json.loads((src / "config.json").read_text())["num_attention_heads"]
    tp = heads + 1
    out = tmp_path / "m"
    assert main(["hf-to-megatron-lm", "--hf", str(src), "--out", str(out), "--tp", str(tp)]) == 1
    err = capsys.readouterr().err
    assert f"error: --tp {tp}: num_attention_heads={heads} is not divisible by" in err
    assert not out.exists()


def test_hf_to_megatron_lm_checks_megatron_cores_version(tmp_path):
    """It writes through megatron-core's dist checkpointing, as megatron-to-nemo does, yet ran
    on any megatron-core."""
    import subprocess

    code = (
        "import importlib.metadata as md, sys\n"
        "real = md.version\n"
        "md.version = lambda n: '0.18.0' if n == 'megatron-core' else real(n)\n"
        "from nemo_d3s.convert.__main__ import main\n"
        f"sys.exit(main(['hf-to-megatron-lm', '--hf', {str(tmp_path / 'hf')!r}, '--out', "
        f"{str(tmp_path / 'out')!r}]))\n"
    )
    repo = os.path.dirname(os.path.dirname(HERE))
    env = {**os.environ, "PYTHONPATH": repo}
    env.pop("NEMO_D3S_ALLOW_UNTESTED", None)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=WAIT_S
    )
    assert r.returncode == 1, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "megatron-core 0.18.0 is installed, tested:" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a multi-rank equality run of 20-60 s: the slow tier (docs/ci.md)
def test_a_full_disk_while_writing_a_megatron_lm_save_is_one_error_line(tmp_path):
    """torch.distributed.checkpoint's CheckpointException (a BaseException) came out as a
    traceback, after megatron-core's own log line; a file-size limit stands in for the full
    disk (the same failed write), and the line names it instead of only the free space."""
    import subprocess

    src = tiny(tmp_path / "src", "llama")
    script = tmp_path / "limited.py"
    script.write_text(
        "import resource, signal, sys\n"
        "if __name__ == '__main__':\n"
        "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))\n"
        "    from nemo_d3s.convert.__main__ import main\n"
        "    sys.exit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "m"
    repo = os.path.dirname(os.path.dirname(HERE))
    r = subprocess.run(
        [sys.executable, str(script), "hf-to-megatron-lm", "--hf", str(src), "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": repo},
        timeout=WAIT_S,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    # (not counted: torch's own warning on importing a CUDA build without a GPU, as the py312
    # leg's torch 2.15 from PyPI does, torch/utils/cpp_extension.py:183)
    lines = [x for x in r.stderr.splitlines() if x.strip() and "No CUDA runtime is found" not in x]
    assert len(lines) == 1 and lines[0].startswith(f"error: could not write --out '{out}': "), lines
    assert (
        "file-size limit (ulimit -f) is 20000 bytes" in lines[0]
        and "nothing was written" in lines[0]
    )
    assert (
        not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".m")] == []
    )


def test_verify_reads_a_megatron_lm_save(tmp_path, capsys):
    """``verify --ckpt <Megatron-LM save>`` said "is not a Megatron checkpoint: no
    megatron/layout.json": it looked for the shard layout of this project's checkpoints before
    reading the save (megatron-to-hf reads it); now it compares its logits."""
    from nemo_d3s.convert.__main__ import main

    src = tiny(tmp_path / "src", "llama")
    assert (
        main(["hf-to-megatron-lm", "--hf", str(src), "--out", str(tmp_path / "m"), "--quiet"]) == 0
    )
    capsys.readouterr()
    assert main(["verify", "--hf", str(src), "--ckpt", str(tmp_path / "m")]) == 0
    out = capsys.readouterr()
    assert "OK: max abs logit error" in out.out and "Megatron-LM torch_dist" in out.out
    assert "not a Megatron checkpoint" not in out.err
