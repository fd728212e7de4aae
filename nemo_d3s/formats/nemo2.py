"""NeMo 2 checkpoints: ``DIR/weights/`` (a megatron-core ``dist_checkpointing`` checkpoint in
the ``torch_dist`` format) + ``DIR/context/`` (``model.yaml``: the model config as NeMo's
fiddle YAML; ``nemo_tokenizer/``: the HF tokenizer files; ``artifacts/``: the generation
config). What NeMo users have after SFT (``llm.import_ckpt`` writes the same layout).

The Megatron backend starts training from such a folder (``model.name=<NeMo 2 folder>``:
:func:`open_nemo2_weights` for the weights, :func:`write_side_folder` for config and
tokenizer); ``nemo-d3s-convert`` reads and writes them.

Reading needs neither NeMo nor megatron-core, and runs no pickle from the checkpoint:

- ``context/model.yaml`` is read with ``yaml.safe_load`` and mapped to an HF config dict
  (``nemo2_context.hf_config_from_nemo``; Llama / Llama 3.1 RoPE scaling, Mistral, Qwen2).
- ``weights/.metadata`` (torch DCP's index, a pickle) is read with an unpickler that builds
  only the DCP/megatron metadata classes, torch.Size and dtypes (:class:`_MetadataUnpickler`);
  anything else is refused. Tensors are ``torch.load(weights_only=True)`` of their byte
  ranges in ``__*.distcp``, as torch's own reader does; ``common.pt`` is never read.
- The tensors are the global (TP1) Megatron tensors under NeMo's names
  (``module.decoder.layers.self_attention.linear_qkv.weight`` ...), every per-layer tensor
  stacked on a leading layer axis and stored one chunk per layer (per TP shard). They go
  through the weight table as a TP1 x PP1 transformer-engine layout, so
  :class:`Nemo2Reader` is a ``shards.ShardedReader`` whose shard tensors come from the
  DCP chunks of one layer at a time.

Writing (``backends/megatron/nemo2_writer.write_nemo2``, in the backend because it needs
megatron-core) uses megatron-core's own ``dist_checkpointing.save`` with
NeMo's key names (one ShardedTensor per layer, the ``_extra_state`` objects NeMo's modules
expect) and copies ``context/`` from a NeMo checkpoint of the same model, which is what NeMo
reads the model back with. It holds the whole model in memory (megatron-core's saver takes
the full state dict), unlike the HF export.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.nemo2_context import hf_config_from_nemo
from nemo_d3s.formats.shards import ShardedReader
from nemo_d3s.formats.spec import ModelSpec
from nemo_d3s.formats.weights import Layout, local_names, local_shape

__all__ = [
    "Nemo2Reader",
    "open_nemo2_weights",
    "open_dcp_weights",
    "write_side_folder",
    "NEMO_PREFIX",
]

NEMO_PREFIX = "module."
_DTYPE_NAMES = (
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)


# ============================================================================ weights/.metadata
class _Record:
    """Stand-in for a pickled metadata class: keeps the attributes, runs no code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)


class _TensorProperties(_Record):
    """DCP pickles TensorProperties as (dtype, layout, requires_grad, memory_format, pin_memory)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            self.dtype = state[0]
        else:
            super().__setstate__(state)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP ``.metadata`` without running pickled code: torch.Size, dtypes, layouts and the
    DCP / megatron metadata dataclasses (rebuilt as :class:`_Record`); anything else is
    refused."""

    _RECORDS = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.distributed.checkpoint.planner": {"TensorWriteData", "WriteItem", "SavePlan"},
        "megatron.core.dist_checkpointing.strategies.torch": {"MCoreMetadata", "MCoreSavePlan"},
    }

    def __init__(self, f, path: Path) -> None:
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.distributed.checkpoint.metadata", "TensorProperties"):
            return _TensorProperties
        if name in self._RECORDS.get(module, ()):
            return type(name, (_Record,), {})
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and name in _DTYPE_NAMES:
            return getattr(torch, name)
        if (module, name) in (
            ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
            ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ):
            return lambda *a, **k: a[0] if a else None
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda n: getattr(torch, str(n).replace("torch.", ""), None)
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


class _DcpIndex:
    """Global shape, dtype and per-chunk byte ranges of every tensor of a DCP folder."""

    def __init__(self, weights: Path) -> None:
        self.weights = weights
        meta = weights / "metadata.json"
        try:
            backend = json.loads(meta.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{str(meta)!r} is not valid JSON: {e}") from None
        if not isinstance(backend, dict) or backend.get("sharded_backend") != "torch_dist":
            got = backend.get("sharded_backend") if isinstance(backend, dict) else backend
            raise ConfigError(
                f"{str(meta)!r}: sharded_backend={got!r}; only torch_dist checkpoints are read"
            )
        path = weights / ".metadata"
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f, path).load()
            sd_meta, storage = md.state_dict_metadata, md.storage_data
            self.tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
            for fqn, m in sd_meta.items():
                props = getattr(m, "properties", None)
                if props is not None and hasattr(m, "size"):
                    self.tensors[str(fqn)] = (tuple(int(x) for x in m.size), props.dtype)
            self.chunks: Dict[str, List[Tuple[Tuple[int, ...], str, int, int]]] = {}
            for idx, info in storage.items():
                fqn = str(idx.fqn)
                if fqn in self.tensors:
                    if getattr(info, "transform_descriptors", None):
                        raise ValueError(
                            f"{fqn}: transformed (compressed) storage is not supported"
                        )
                    rel = str(info.relative_path)
                    if "/" in rel or rel.startswith(".."):
                        raise ValueError(f"{fqn}: storage path {rel!r} points outside weights/")
                    offsets = tuple(int(x) for x in (idx.offset or ()))
                    self.chunks.setdefault(fqn, []).append(
                        (offsets, rel, int(info.offset), int(info.length))
                    )
        except (
            OSError,
            EOFError,
            pickle.UnpicklingError,
            AttributeError,
            TypeError,
            ValueError,
        ) as e:
            raise ConfigError(
                f"{str(path)!r}: not a readable NeMo 2 / torch_dist index ({e})"
            ) from None

    def read(self, fqn: str, layer: Optional[int] = None) -> torch.Tensor:
        """The global tensor ``fqn`` (``layer``: only that index of the leading layer axis),
        assembled from its chunks; each chunk is checked against the index."""
        shape, dtype = self.tensors[fqn]
        want = shape[1:] if layer is not None else shape
        out = torch.empty(want, dtype=dtype)
        filled = 0
        for offsets, rel, start, length in self.chunks.get(fqn, []):
            if layer is not None and offsets[0] != layer:
                continue
            path = self.weights / rel
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    raw = f.read(length)
                t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as e:
                raise ConfigError(
                    f"{str(path)!r}: chunk of {fqn!r} at {list(offsets)} is unreadable ({e})"
                ) from None
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != dtype
                or t.dim() != len(shape)
                or any(o + s > g for o, s, g in zip(offsets, t.shape, shape))
            ):
                raise ConfigError(
                    f"{str(path)!r}: chunk of {fqn!r} at {list(offsets)} does not fit "
                    f"{list(shape)} {dtype}"
                )
            if layer is not None:
                t, offsets = t[0], offsets[1:]
            region = out
            for d, (o, s) in enumerate(zip(offsets, t.shape)):
                region = region.narrow(d, o, s)
            region.copy_(t)
            filled += t.numel()
        if filled != math.prod(want):
            raise ConfigError(
                f"{str(self.weights)!r}: the chunks of "
                f"{fqn!r}{'' if layer is None else f' layer {layer}'} cover {filled} of "
                f"{math.prod(want)} elements"
            )
        return out


def _nemo_key(local: str, prefix: str = NEMO_PREFIX) -> Tuple[str, Optional[int]]:
    """A TP1 (transformer-engine names) local parameter -> (DCP fqn, layer index or None):
    megatron-core's ``TransformerBlock.sharded_state_dict`` stacks a homogeneous block's
    layers on a leading axis under one key (``decoder.layers.<rest>``). ``prefix``: NeMo's
    "module.", or "" for Megatron-LM / Megatron-Bridge (the model's own keys)."""
    parts = local.split(".")
    if parts[:2] == ["decoder", "layers"]:
        return prefix + "decoder.layers." + ".".join(parts[3:]), int(parts[2])
    return prefix + local, None


_LOCAL_SPEC_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


class Nemo2Reader(ShardedReader):
    """``shards.ShardedReader`` over a megatron-core torch_dist checkpoint (NeMo 2's
    ``weights/``, a Megatron-LM / Megatron-Bridge ``iter_XXXXXXX/``): a TP1 x PP1
    transformer-engine layout whose local tensors are read from the DCP chunks of one layer.
    ``prefix``: the keys' prefix; ``config_name``: where the model's shape came from (errors)."""

    def __init__(
        self,
        folder: Path,
        spec: ModelSpec,
        index: _DcpIndex,
        padded_vocab: int,
        prefix: str = NEMO_PREFIX,
        config_name: str = "context/model.yaml",
    ) -> None:
        self.index, self.prefix_key, self.config_name = index, prefix, config_name
        super().__init__(folder, spec, Layout(1, 1, 0, 0, padded_vocab, te=True))

    def fqn(self, local: str) -> Tuple[str, Optional[int]]:
        fqn, layer = _nemo_key(local, self.prefix_key)
        if fqn not in self.index.tensors:  # a checkpoint saved with the local spec's own names
            for te, plain in _LOCAL_SPEC_NAMES.items():
                alt = fqn.replace(te, plain)
                if alt in self.index.tensors:
                    return alt, layer
        return fqn, layer

    def check(self) -> torch.dtype:
        """Every tensor the table needs is indexed with the shape config says; returns the
        stored dtype."""
        dtypes = set()
        for local in local_names(self.spec, self.saved):
            fqn, layer = self.fqn(local)
            if fqn not in self.index.tensors:
                raise ConfigError(
                    f"{str(self.index.weights / '.metadata')!r} holds no tensor {fqn!r} (not a "
                    f"{self.spec.architecture} checkpoint?)"
                )
            shape, dtype = self.index.tensors[fqn]
            want = local_shape(local, self.spec, self.saved)
            if layer is not None:
                want = (self.spec.num_layers,) + want
            if shape != want:
                raise ConfigError(
                    f"{str(self.index.weights / '.metadata')!r}: tensor {fqn!r} has shape "
                    f"{list(shape)}, {self.config_name} gives {list(want)}"
                )
            if dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ConfigError(
                    f"{str(self.index.weights / '.metadata')!r}: tensor {fqn!r} is {dtype}"
                )
            dtypes.add(dtype)
        if len(dtypes) != 1:
            raise ConfigError(
                f"{str(self.index.weights)!r} stores parameters in several dtypes "
                f"{sorted(map(str, dtypes))}"
            )
        return dtypes.pop()

    def _tensor(self, tp_rank: int, stage: int, key: str) -> torch.Tensor:
        fqn, layer = self.fqn(key)
        if fqn not in self.index.tensors:
            raise ConfigError(f"{str(self.index.weights / '.metadata')!r} holds no tensor {fqn!r}")
        return self.index.read(fqn, layer)


def open_nemo2_weights(folder: Path, spec: ModelSpec) -> Tuple[Nemo2Reader, torch.dtype]:
    return open_dcp_weights(folder / "weights", spec, NEMO_PREFIX, "context/model.yaml")


def open_dcp_weights(
    weights: Path, spec: ModelSpec, prefix: str, config_name: str
) -> Tuple[Nemo2Reader, torch.dtype]:
    """The GPT weights of the torch_dist folder ``weights`` under keys ``prefix`` + the
    model's own names, checked against ``spec`` (from ``config_name``); the padded
    vocabulary is the stored embedding's rows. Returns (reader, stored dtype)."""
    index = _DcpIndex(weights)
    emb = prefix + "embedding.word_embeddings.weight"
    if emb not in index.tensors:
        raise ConfigError(
            f"{str(weights / '.metadata')!r} holds no tensor {emb!r} (not a GPT checkpoint?)"
        )
    padded = index.tensors[emb][0][0]
    if padded < spec.vocab_size:
        raise ConfigError(
            f"{str(weights)!r}: {emb!r} has {padded} rows, fewer than vocab_size="
            f"{spec.vocab_size} in {config_name}"
        )
    reader = Nemo2Reader(weights.parent, spec, index, padded, prefix, config_name)
    return reader, reader.check()


def write_side_folder(folder: Path, dst: Path) -> Path:
    """What the Megatron backend reads besides the weights, for a NeMo 2 training start, as
    an HF-style folder ``dst``: config.json (from context/model.yaml), the tokenizer files of
    context/nemo_tokenizer/ and context/artifacts/generation_config.json when present."""
    folder = Path(folder)
    cfg = hf_config_from_nemo(folder)
    tok = folder / "context" / "nemo_tokenizer"
    files = sorted(p for p in tok.iterdir() if p.is_file()) if tok.is_dir() else []
    if not any(p.name == "tokenizer_config.json" for p in files):
        raise ConfigError(
            f"{str(tok)!r} holds no tokenizer_config.json: the NeMo 2 checkpoint has no HF "
            "tokenizer (convert it with nemo-d3s-convert megatron-to-hf --hf-config DIR "
            "first)"
        )
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(
        json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    for p in files:
        shutil.copyfile(p, dst / p.name)
    gen = folder / "context" / "artifacts" / "generation_config.json"
    if gen.is_file():
        shutil.copyfile(gen, dst / gen.name)
    return dst
