"""Agreeing on short texts across a process group without pickle: ranks that each checked a share of
something (a checkpoint's files) see every rank's findings, so all raise the same error or go on
together. Collectives: an all-gather of one int64 and one of max-length bytes, on the group's
device. Memory: world x the longest text."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from nemo_d3s.distributed.comm import all_gather_varlen, collective_device, is_single

__all__ = ["all_gather_texts"]

_NONE, _TEXT = 0, 1  # the first byte of an encoded entry: None or a UTF-8 text


def _encode(text: Optional[str]) -> bytes:
    return bytes([_NONE]) if text is None else bytes([_TEXT]) + text.encode("utf-8")


def _decode(raw: bytes) -> Optional[str]:
    return None if raw[0] == _NONE else raw[1:].decode("utf-8")


def all_gather_texts(
    text: Optional[str], group: Optional[dist.ProcessGroup] = None
) -> List[Optional[str]]:
    """Every member's text (or None) in group-rank order; None group: ``[text]``."""
    if is_single(group):
        return [text]
    raw = _encode(text)
    mine = torch.tensor(list(raw), dtype=torch.uint8, device=collective_device(group))
    gathered, counts = all_gather_varlen(mine, group)
    out, at = [], 0
    for n in counts.tolist():
        out.append(_decode(bytes(gathered[at : at + n].cpu().tolist())))
        at += n
    return out
