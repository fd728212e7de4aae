"""What the Megatron backend decides before CUDA starts, checked on the CPU:

- Transformer Engine: on CUDA the TE layer spec, and a TE that does not import is an error
  naming the import error unless ``transformer_impl=local`` asks for the local spec by name
  (before: a silent fall-back to the local spec);
- the local spec gives the block torch's RMSNorm as its final norm (megatron-core would
  pick Apex's LayerNorm-only FusedLayerNorm when Apex is installed but TE is not);
- ``CUDA_DEVICE_MAX_CONNECTIONS`` is set before anything can initialise CUDA.
"""

from __future__ import annotations

import sys

import pytest
import torch

from nemo_d3s.backends.megatron.model import transformer_engine_error, use_transformer_engine
from nemo_d3s.config import ConfigError

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_a_broken_transformer_engine_is_an_error_on_cuda(monkeypatch):
    # A TE whose import fails (None in sys.modules: "import halted"), whatever is installed here.
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    err = transformer_engine_error()
    assert err is not None and "transformer_engine.pytorch" in err
    with pytest.raises(
        ConfigError,
        match=r"transformer_impl=transformer_engine .*import transformer_engine\.pytorch "
        r"failed.*transformer_impl=local",
    ):
        use_transformer_engine("transformer_engine", CUDA)
    assert use_transformer_engine("local", CUDA) is False  # asked for by name
    assert (
        use_transformer_engine("transformer_engine", CPU) is False
    )  # the CPU has only the local spec


def test_an_unknown_transformer_impl_is_refused():
    with pytest.raises(ConfigError, match="transformer_impl='te'.*transformer_engine, local"):
        use_transformer_engine("te", CPU)


def test_the_local_spec_takes_torch_norms_even_with_apex(monkeypatch, tmp_path):
    """Pretend Apex is installed (what megatron-core's transformer_block decided at import):
    the final norm must still be torch's RMSNorm."""
    import megatron.core.transformer.transformer_block as tb
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from nemo_d3s.formats.spec import ModelSpec
    from nemo_d3s.backends.megatron.model import build_stage, transformer_config
    from nemo_d3s.formats.weights import Layout

    class ApexOnly(WrappedTorchNorm):  # stands in for FusedLayerNorm, which refuses RMSNorm
        def __new__(cls, config, *a, **k):
            raise AssertionError(f"({config.normalization}) is not supported in FusedLayerNorm")

    monkeypatch.setattr(tb, "LayerNormImpl", ApexOnly)
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _tiny_hf import make_tiny_hf

    spec = ModelSpec.from_folder(str(make_tiny_hf(tmp_path / "m", "llama")))
    config = transformer_config(spec, tp=1, pp=1, params_dtype=torch.float32, device=CPU)
    layout = Layout(tp=1, pp=1, tp_rank=0, pp_rank=0, padded_vocab=384, te=False)
    with torch.device("meta"):
        model = _build_in_one_rank_world(
            lambda: build_stage(
                spec,
                config,
                layout,
                pre_process=True,
                post_process=True,
                device=torch.device("meta"),
            )
        )
    norm = model.decoder.final_layernorm
    assert isinstance(norm, torch.nn.RMSNorm), type(norm)
    assert len(model.decoder.layers) == spec.num_layers


def _build_in_one_rank_world(build):
    """Megatron's groups on a private one-rank gloo group (in-memory store), torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1, 1)
        try:
            return build()
        finally:
            ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def test_cuda_connections_is_set_before_cuda_can_start(monkeypatch, folders):
    """The backend sets CUDA_DEVICE_MAX_CONNECTIONS before it resolves its device (and so
    before init_world's torch.cuda.set_device); a value the user set is kept."""
    import nemo_d3s.backends.megatron.backend as backend
    import nemo_d3s.backends.megatron.build as build
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    class Stop(Exception):
        pass

    seen = []

    def resolve_device(name):
        seen.append(__import__("os").environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        raise Stop

    monkeypatch.setattr(build, "resolve_device", resolve_device)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    with pytest.raises(Stop):
        backend.MegatronBackend(MegatronBackendConfig(model=folders["llama"], device="cpu"))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")
    with pytest.raises(Stop):
        backend.MegatronBackend(MegatronBackendConfig(model=folders["llama"], device="cpu"))
    assert seen == ["1", "4"]


def test_check_options_refuses_an_unknown_transformer_impl():
    """The backend's option check (also the dry run's, through the backend registry)."""
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig, check_options

    check_options(MegatronBackendConfig(transformer_impl="local"))
    with pytest.raises(
        ValueError,
        match="model.params.transformer_impl='te': expected one of transformer_engine, local",
    ):
        check_options(MegatronBackendConfig(transformer_impl="te"))
