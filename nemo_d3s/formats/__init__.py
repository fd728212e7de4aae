"""The file-format layer: what a checkpoint folder holds (Hugging Face, Megatron shards, NeMo 2,
Megatron-LM / Megatron-Bridge) and how to read and write it. torch + safetensors only: no
process group, no Megatron, no transformers model classes; :func:`detect.detect_format` is the
one place that tells formats apart. This ``__init__`` imports nothing (submodules by name), so
reading a config does not import torch.
"""
