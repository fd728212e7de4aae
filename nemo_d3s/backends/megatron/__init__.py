"""Megatron-core backend (``model.backend=megatron``): a ``GPTModel`` sharded over tensor,
pipeline and data parallelism, trained through Megatron's own schedules. Nothing outside
this package imports megatron-core; checkpoint file formats live in ``nemo_d3s/formats``.
"""

import logging as _logging
import warnings as _warnings

# Start-up notices of megatron-core that a user cannot act on, silenced here because every
# submodule that imports megatron-core is imported through this package: the optional CUDA
# extensions (Transformer Engine, Apex) being absent (on CPU they cannot be used; on CUDA the
# backend refuses to run without Transformer Engine unless asked), the deprecation of
# megatron-core's own default cuda_graph_scope="full" (transformer_config.py, warned on every
# TransformerConfig), and Megatron-FSDP's INFO lines at import (this backend does not use
# FSDP). Each filter matches one message from megatron.core's modules; other warnings show.
for _message in (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
):
    _warnings.filterwarnings(
        "ignore", message=_message, category=UserWarning, module=r"megatron\.core"
    )
_logging.getLogger("megatron.core.distributed.fsdp").setLevel(_logging.WARNING)


def __getattr__(name):
    # Importing megatron-core takes seconds; only a run that uses this backend pays for it.
    if name == "MegatronBackend":
        from nemo_d3s.backends.megatron.backend import MegatronBackend

        return MegatronBackend
    raise AttributeError(name)
