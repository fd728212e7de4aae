"""One rank of the 1-vs-2-process test of the TRL plugin (tests/integrations/test_trl_plugin.py).

Run as ``torchrun --nproc_per_node N _trl_ranks.py MODEL_DIR OUT_DIR PRESET STEP``: accelerate
picks the torchrun world up (gloo on the CPU). Every rank builds ``D3SGRPOTrainer`` on the
same tiny model and cuts ITS slice of one fixed synthetic generation batch (8 rollouts, 2
prompts x G = 4; process p holds global rows [p B, (p + 1) B) as in TRL), through the
plugin's own ``_d3s_cut`` (the all-gather of the advantages, the entropy pass over the kept
rows, the DP-global token top-K), then runs the plugin's loss on the cut batch (compaction,
TRL's ``dapo`` loss and its per-row metric gathers, which need equal rows on every process).
Each rank writes what it kept, the rows its loss ran on and the loss as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def synthetic_batch(n_total: int = 8, p: int = 4, c: int = 6):
    g = torch.Generator().manual_seed(7)
    prompt_ids = torch.randint(0, 256, (n_total, p), generator=g)
    completion_ids = torch.randint(0, 256, (n_total, c), generator=g)
    lengths = torch.tensor([6, 3, 5, 6, 2, 6, 4, 1])[:n_total]
    completion_mask = (torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 1.0, 0.0, 3.0])[:n_total]
    adv = torch.empty_like(rewards)
    for s in range(0, n_total, 4):  # TRL's scale_rewards="group"
        r = rewards[s : s + 4]
        adv[s : s + 4] = (r - r.mean()) / (r.std() + 1e-4)
    return prompt_ids, completion_ids, completion_mask, rewards, adv


def main(model_dir: str, out_dir: str, preset: str, step: str) -> None:
    """STEP: the global step of 3 (progress STEP / 2: 0 -> N = G/8, 2 -> N = G/2)."""
    from datasets import Dataset
    from trl import GRPOConfig

    from _trl_record import SelectionRecorder  # beside this file (the script's own folder)

    from nemo_d3s.core.presets import D3SConfig
    from nemo_d3s.integrations.trl import D3SGRPOTrainer

    import nemo_d3s.integrations.trl.trainer as plugin

    loss_rows = []

    def compact_rows(*args, **kwargs):
        out = compact(*args, **kwargs)
        loss_rows.append(int(out[0]["completion_ids"].shape[0]))
        return out

    compact, plugin.compact_rows = plugin.compact_rows, compact_rows

    class Recorder(SelectionRecorder, D3SGRPOTrainer):
        pass

    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        per_device_train_batch_size=8 // world,
        num_generations=4,
        max_completion_length=6,
        report_to="none",
        save_strategy="no",
        seed=0,
        bf16=False,
    )
    cfg = D3SConfig.from_preset(preset, min_kept_tokens=0)
    trainer = Recorder(
        model=model_dir,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}),
        d3s=cfg,
    )
    rank = trainer.accelerator.process_index
    prompt_ids, completion_ids, completion_mask, rewards, adv = synthetic_batch()
    b = 8 // world
    mine = slice(rank * b, (rank + 1) * b)
    trainer._d3s_rewards = rewards
    output = {
        "prompt_ids": prompt_ids[mine],
        "prompt_mask": torch.ones_like(prompt_ids[mine]),
        "completion_ids": completion_ids[mine],
        "completion_mask": completion_mask[mine],
        "advantages": adv[mine],
        "num_items_in_batch": completion_mask.sum(),
    }
    trainer.state.max_steps, trainer.state.global_step = 3, int(step)
    trainer.model.train()
    cut = trainer._d3s_cut(output)
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(trainer.model, cut)
    sel = trainer.last_selection
    rows = (sel["stage"].kept_rows + rank * b).tolist()
    record = {
        "rank": rank,
        "world": world,
        "sample_keep_global": sel["sample_keep_global"].tolist(),
        "rows": rows,
        "token_keep": sel["tokens"].token_keep.tolist(),
        "entropy": sel["entropy"].tolist() if sel["entropy"] is not None else None,
        "num_items_in_batch": float(cut["num_items_in_batch"]),
        "cut_rows": int(cut["completion_ids"].shape[0]),
        "cut_loss_tokens": int((cut["completion_mask"] * cut["tool_mask"]).sum()),
        "loss_rows": loss_rows,
        "loss": float(loss),
    }
    with open(os.path.join(out_dir, f"rank{rank}_of{world}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
