"""One rank of the 2-process ``steps_per_generation`` / ``num_iterations`` run of the TRL plugin
(tests/integrations/test_trl_generation_reuse.py).

Run as ``torchrun --nproc_per_node 2 _trl_reuse_ranks.py MODEL_DIR OUT_DIR``: accelerate picks
the torchrun world up (gloo on the CPU) and ``Trainer.train()`` runs 4 optimizer steps
(steps_per_generation 2, gradient accumulation 2, num_iterations 2: two generations, each used
for two optimizer steps). Each rank writes, per generation, what it kept and what each of its
micro-batches held, as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(model_dir: str, out_dir: str) -> None:
    from datasets import Dataset
    from trl import GRPOConfig

    from _trl_record import SelectionRecorder  # beside this file (the script's own folder)

    from nemo_d3s.core.presets import D3SConfig
    from nemo_d3s.integrations.trl import D3SGRPOTrainer

    class Recorder(SelectionRecorder, D3SGRPOTrainer):
        def _compute_loss(self, model, inputs):
            tool = inputs["tool_mask"]
            self.micro.append(
                {
                    "rows": int(tool.shape[0]),
                    "loss_tokens": int((tool * inputs["completion_mask"]).sum()),
                    "zero_rows": int((tool.sum(1) == 0).sum()),
                    "num_items_in_batch": float(inputs["num_items_in_batch"]),
                    "ids": inputs["completion_ids"].tolist(),
                }
            )
            return super()._compute_loss(model, inputs)

        def _d3s_cut(self, output):
            cut = super()._d3s_cut(output)
            sel = self.last_selection
            self.gens.append(
                {
                    "keep_global": sel["sample_keep_global"].tolist(),
                    "kept_local": int(sel["stage"].kept_rows.numel()),
                    "kept_tokens_local": int(sel["tokens"].token_keep.sum()),
                    "cut_rows": int(cut["completion_ids"].shape[0]),
                }
            )
            return cut

    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        per_device_train_batch_size=3,  # 12 rollouts: 3 prompts, a group split by the ranks
        num_generations=4,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        max_steps=4,
        max_completion_length=6,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        bf16=False,
    )
    trainer = Recorder(
        model=model_dir,
        reward_funcs=lambda completions, **kw: [float(sum(map(ord, c)) % 5) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"count to {i}" for i in range(4)]}),
        d3s=D3SConfig.from_preset("d3s", min_kept_tokens=0),
    )
    trainer.micro, trainer.gens = [], []
    trainer.train()
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    record = {"gens": trainer.gens, "micro": trainer.micro, "param_sum": float(params.sum())}
    with open(os.path.join(out_dir, f"rank{rank}_of{world}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
