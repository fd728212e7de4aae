"""What goes with a model's weights: HF ``config.json``, ``generation_config.json`` and
tokenizer files. One tokenizer rule for every reader: ``tokenizer_config.json`` and one of
``tokenizer.json`` / ``tokenizer.model`` / ``vocab.json``, other known files when present.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.nemo2_context import hf_config_from_nemo

__all__ = [
    "GENERATION_CONFIG",
    "TOKENIZER_FILES",
    "TOKENIZER_MODEL",
    "generation_file",
    "nemo2_side_files",
    "read_json",
    "tokenizer_files",
]

GENERATION_CONFIG = "generation_config.json"
# Tokenizer files copied with a model (whichever exist); at least one of TOKENIZER_MODEL
# must, or transformers' AutoTokenizer has nothing to load.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
TOKENIZER_MODEL = ("tokenizer.json", "tokenizer.model", "vocab.json")


def read_json(path: Path) -> Any:
    """The JSON at ``path``; ConfigError naming the file when it is unreadable or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{str(path)!r} is not valid JSON: {e}") from None


def tokenizer_files(folder: Path, *, role: str, hint: str) -> List[Path]:
    """The tokenizer files of ``folder`` (each JSON one parsed); ConfigError naming what is
    missing, ``role`` (what the folder is to the caller) and ``hint`` (the way out)."""
    have = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
    names = {p.name for p in have}
    missing = [n for n in ("tokenizer_config.json",) if n not in names]
    if not any(n in names for n in TOKENIZER_MODEL):
        missing.append(" or ".join(TOKENIZER_MODEL))
    if missing:
        raise ConfigError(
            f"{str(folder)!r} ({role}) has no tokenizer: missing {', '.join(missing)}; the "
            f"converted model needs its tokenizer files ({hint})"
        )
    for p in have:
        if p.suffix == ".json":
            read_json(p)
    return have


def generation_file(path: Path) -> Optional[Path]:
    """``path`` when it is a generation config (a JSON object); None when it is absent."""
    if not path.is_file():
        return None
    if not isinstance(read_json(path), dict):
        raise ConfigError(f"{str(path)!r} must hold a JSON object")
    return path


def nemo2_side_files(
    folder: Path, *, hint: str
) -> Tuple[Dict[str, Any], Optional[Path], List[Path]]:
    """(HF config from context/model.yaml, context/artifacts/generation_config.json or None,
    the tokenizer files of context/nemo_tokenizer/) of the NeMo 2 checkpoint ``folder``."""
    folder = Path(folder)
    return (
        hf_config_from_nemo(folder),
        generation_file(folder / "context" / "artifacts" / GENERATION_CONFIG),
        tokenizer_files(folder / "context" / "nemo_tokenizer", role="NeMo 2 context", hint=hint),
    )
