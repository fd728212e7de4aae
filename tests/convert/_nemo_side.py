"""The NeMo side of the NeMo 2 tests, run with an interpreter that has nemo-toolkit 2.x
(its LLM collection): ``python _nemo_side.py import HF_DIR NEMO_DIR`` makes a NeMo 2
checkpoint with NeMo's own HF importer (``llm.import_ckpt``); ``python _nemo_side.py export
NEMO_DIR HF_DIR`` has NeMo load a NeMo 2 checkpoint and export it to HF
(``llm.export_ckpt``). Both on the CPU: NeMo and megatron-core's dist_checkpointing assume
CUDA in a few places, patched here only (this file never runs inside nemo_d3s)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def _cpu_patches() -> None:
    if torch.cuda.is_available():
        return
    # dist_checkpointing: a CUDA sync after non-blocking copies, and a failure flag
    # allocated on the current CUDA device.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    import contextlib

    torch.cuda.Stream = lambda *a, **k: None  # NeMo wraps DDP set-up in a side stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    from megatron.core.transformer.transformer_config import TransformerConfig

    post = TransformerConfig.__post_init__

    def cpu_post_init(self):  # the kernels these flags ask for need transformer-engine / CUDA
        for flag in (
            "apply_rope_fusion",
            "persist_layer_norm",
            "bias_activation_fusion",
            "bias_dropout_fusion",
            "masked_softmax_fusion",
            "gradient_accumulation_fusion",
        ):
            setattr(self, flag, False)
        post(self)

    TransformerConfig.__post_init__ = cpu_post_init
    from nemo.lightning.io import connector

    setup = connector.ModelConnector.nemo_setup

    def cpu_setup(self, model, trainer=None, *a, **k):
        k.setdefault("ckpt_async_save", False)  # the async writer needs CUDA
        return setup(self, model, trainer, *a, **k)

    connector.ModelConnector.nemo_setup = cpu_setup
    from nemo.lightning.io import pl

    pl._fix_tensors_device = lambda ckpt: ckpt  # moves loaded tensors to the current CUDA device
    from nemo.lightning import io

    apply = io.apply_transforms

    def local_spec_names(source, target, mapping, *a, **k):
        # Without transformer-engine NeMo builds the local layer spec (input_layernorm /
        # pre_mlp_layernorm modules), but its HF importer and exporter map the TE-fused names
        # (the importer then silently leaves the norms at their initial 1.0).
        keys = [
            x for m in (source, target) if hasattr(m, "state_dict") for x in m.state_dict().keys()
        ]
        if any("decoder.layers." in x and ".input_layernorm." in x for x in keys):

            def local(name):
                return name.replace(
                    "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"
                ).replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")

            mapping = {local(m): local(v) for m, v in mapping.items()}
        return apply(source, target, mapping, *a, **k)

    io.apply_transforms = local_spec_names


def main() -> None:
    _cpu_patches()
    from nemo.collections import llm

    cmd, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if cmd == "import":
        import json

        arch = json.loads((src / "config.json").read_text())["architectures"][0]
        from nemo.collections.llm.gpt.model.llama import HFLlamaImporter
        from nemo.collections.llm.gpt.model.qwen2 import HFQwen2Importer

        importer = (HFQwen2Importer if arch == "Qwen2ForCausalLM" else HFLlamaImporter)(str(src))
        importer.trust_remote_code = (
            False  # read by .config before apply() sets it (a local folder)
        )
        model = (llm.Qwen2Model if arch == "Qwen2ForCausalLM" else llm.LlamaModel)(importer.config)
        llm.import_ckpt(model=model, source=f"hf://{src}", output_path=out, overwrite=True)
    elif cmd == "export":
        llm.export_ckpt(path=src, target="hf", output_path=out, overwrite=True)
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    import nemo

    print(f"nemo-toolkit {nemo.__version__}: {cmd} done")


if __name__ == "__main__":
    main()
