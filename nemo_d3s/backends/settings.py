"""Settings every policy backend shares (the optimizer, the LR schedule, the seeded HF
sampler): one dataclass that the backends' typed configs extend, so a setting means the
same thing, with the same default, whichever backend a run uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["PolicySettings"]


@dataclass
class PolicySettings:
    """lr, weight_decay, adam_betas, adam_eps: AdamW (decoupled weight decay on every
    parameter). grad_clip: max global grad norm (<= 0 disables clipping; the norm is still
    reported). scheduler: "constant", "linear" or "cosine" decay to ``min_lr_ratio`` x lr
    after ``warmup_steps`` of linear warm-up (the decaying ones need ``total_steps``).
    use_reference: keep a frozen copy of the initial policy for the KL term.
    generation_batch_size: rows decoded together by the HF engine (None = all at once).
    stop_tokens: extra tokens that end a response like EOS, when the tokenizer has them as
    single tokens (ChatML models sometimes close a turn by opening the next one).
    use_chat_template: wrap each prompt as one user turn with the tokenizer's chat template.
    dist_timeout_minutes: how long a collective waits for a peer rank before the process
    group fails (None = torch's default, 30 minutes), when the backend creates the group.
    pack_sequences: rows packed end to end (``core.packing``); None = the backend's default.
    logit_temperature: the rollouts' sampling temperature T; scoring and the update take
    log-probs and entropy of softmax(logits / T), the distribution the rollouts came from.
    """

    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: Tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    scheduler: str = "constant"
    total_steps: Optional[int] = None
    min_lr_ratio: float = 0.0
    use_reference: bool = False
    gradient_checkpointing: bool = False
    generation_batch_size: Optional[int] = None
    sampler: str = "seeded"
    stop_tokens: Tuple[str, ...] = ("<|im_start|>", "<|endoftext|>")
    use_chat_template: bool = True
    dist_timeout_minutes: Optional[float] = None
    pack_sequences: Optional[bool] = None
    logit_temperature: float = 1.0
