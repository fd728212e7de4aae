"""The file-format layer: what a checkpoint folder holds and how to read and write it,
below the backends (torch + safetensors only: no process group, no Megatron, no
transformers model classes). Used by the Megatron backend, the converter and the dry run;
none of them detects a format itself. See ``docs/architecture.md``.

- ``detect``: :func:`detect_format`, the one function that tells a Hugging Face folder, a
  Megatron sharded checkpoint (training or converted), a NeMo 2 checkpoint and a
  Megatron-LM / Megatron-Bridge checkpoint apart.
- ``spec``: :class:`ModelSpec` from ``config.json`` (or a NeMo 2 ``context/model.yaml``,
  via ``nemo2_context``), vocabulary padding, the layout's divisibility rules.
- ``weights``: the one HF <-> Megatron name / shape table and the lazy HF safetensors reader
  (the to-HF / from-HF adapter, kept apart from training code).
- ``shards``: the Megatron backend's shard files (``layout.json`` + ``tpXX_ppYY.safetensors``)
  and their resharding reader. The running policy's save / load with its optimizer stays in
  ``backends/megatron/checkpoint.py``.
- ``nemo2`` / ``nemo2_context``: reading NeMo 2 checkpoints without NeMo or pickle (the
  writer needs megatron-core and lives in ``backends/megatron/nemo2_writer.py``).
- ``mcore_config`` / ``mcore_dist``: Megatron-LM / Megatron-Bridge / NeMo-RL checkpoints
  (megatron-core ``dist_checkpointing``): the checkpoint a save folder names, the model it
  describes, its weights (through ``nemo2``'s DCP reader); ``pickle_records``: the inert
  unpickling of ``common.pt``.
- ``safetensors_stream``: safetensors files written tensor by tensor.

Submodules are imported by name (``from nemo_d3s.formats.spec import ModelSpec``); this
``__init__`` imports nothing, so reading a config does not import torch.
"""
