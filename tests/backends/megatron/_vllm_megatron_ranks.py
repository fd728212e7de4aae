"""Rank body of test_vllm_megatron.py, run under torchrun (the launch a user has):
python -m torch.distributed.run --standalone --nproc_per_node=2 _vllm_megatron_ranks.py FOLDER
OUT_DIR TP PP [CP [ENGINES_PER_COPY [EP]]]. Each rank writes OUT_DIR/rank{r}.pt (tensors only)."""

from __future__ import annotations

import sys


def main() -> None:
    import torch
    import torch.distributed as dist

    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.engines import build_rollout_engine
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig
    from nemo_d3s.core.loss_config import LossOutput

    folder, out_dir, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    engines = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    ep = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    dist.init_process_group("gloo")
    pol = MegatronBackend(
        MegatronBackendConfig(
            model=folder,
            device="cpu",
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            rollout_engines_per_copy=engines,
            expert_model_parallel_size=ep,
            lr=5e-2,
            grad_clip=0.0,
        )
    )
    engine = build_rollout_engine("vllm", pol, {"dtype": "float32"})
    gen = GenerationConfig(max_new_tokens=8)
    prompts = ["What is 2+3?", "Say hi"]
    before = engine.generate(prompts, 2, gen, [1, 2])
    lp0 = pol.score(before.batch, with_entropy=False).logprobs
    mask = before.batch.response_mask

    def loss_fn(logprobs, rows):  # push the sampled tokens' log-probs up
        return LossOutput(
            loss=-(logprobs * mask[rows].to(logprobs.device).float()).sum(), metric_tensors={}
        )

    pol.train_step(before.batch, loss_fn, 4, denominator=float(mask.sum()))
    engine.sync_weights(pol)
    after = engine.generate(prompts, 2, gen, [1, 2])
    torch.save(
        {
            # at CP > 1 the model-parallel group's engine sits inside the CP wrapper
            "has_engine": torch.tensor((engine.inner if cp > 1 else engine).inner is not None),
            "on_policy": torch.tensor(engine.on_policy),
            "before_ids": before.batch.input_ids,
            "before_mask": mask,
            "before_lp": before.sampling_logprobs,
            "after_ids": after.batch.input_ids,
            "after_mask": after.batch.response_mask,
            "after_lp": after.sampling_logprobs,
            "score0": lp0,
            "score1": pol.score(after.batch, with_entropy=False).logprobs,
            "old_on_new": pol.score(before.batch, with_entropy=False).logprobs,
        },
        f"{out_dir}/rank{dist.get_rank()}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
