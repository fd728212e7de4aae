"""Mixture-of-experts rows of the model description and of the HF <-> Megatron weight table.

Architectures (HF names per decoder layer i; E experts of width F' each, H hidden):

- ``Qwen3MoeForCausalLM``: router ``model.layers.i.mlp.gate.weight`` [E, H], expert e
  ``mlp.experts.e.{gate,up,down}_proj.weight`` ([F', H], [F', H], [H, F']); softmax over
  the E router logits, top-k, renormalised over the k when ``norm_topk_prob``.
- ``MixtralForCausalLM``: router ``block_sparse_moe.gate.weight``, expert e
  ``block_sparse_moe.experts.e.{w1,w3,w2}.weight`` (gate, up, down); top-k renormalised.
- ``Qwen2MoeForCausalLM``: Qwen3-MoE's router and experts, and a shared expert every token
  goes through, ``mlp.shared_expert.{gate,up,down}_proj.weight`` ([Fs, H], [Fs, H], [H, Fs]),
  its output scaled by ``sigmoid(mlp.shared_expert_gate.weight @ x)`` ([1, H]).

Megatron's MoE layer (megatron-core ``MoELayer``) per layer j of a stage, EP ranks holding
E / EP consecutive experts each (EP rank p: experts [p E/EP, (p+1) E/EP)), every expert's
FFN split over ETP ranks like a dense MLP over TP:

- ``mlp.router.weight`` [E, H]: replicated on every rank (a dense parameter);
- local spec (``SequentialMLP``): ``mlp.experts.local_experts.k.linear_fc1.weight``
  [2 F'/ETP, H] (gate rows of ETP rank r, then its up rows) and ``...linear_fc2.weight``
  [H, F'/ETP] for local expert k = global expert p E/EP + k;
- Transformer Engine spec (``TEGroupedMLP``, grouped GEMM): ``mlp.experts.linear_fc1.weightk``
  and ``mlp.experts.linear_fc2.weightk``, the same shapes;
- a shared expert (megatron-core ``SharedExpertMLP``, a dense parameter split over TP like the
  dense MLP): ``mlp.shared_experts.linear_fc1.weight`` [2 Fs/TP, H] (gate rows of TP rank r,
  then its up rows), ``...linear_fc2.weight`` [H, Fs/TP] and the gate ``...gate_weight``
  [1, H] (replicated; megatron-core's ``moe_shared_expert_gate``: the same sigmoid).

Plain Python: no torch, no Megatron.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from nemo_d3s.errors import ConfigError

__all__ = [
    "MOE_ARCHITECTURES",
    "ROUTER_SCORE",
    "expert_count",
    "fused_target",
    "is_expert_param",
    "moe_fields",
    "moe_hf_names",
    "moe_hf_shape",
    "moe_local_names",
    "moe_local_parts",
    "check_megatron_router",
    "moe_transformer_fields",
    "swiglu_rows",
]

# architecture -> (the layer's MoE block, the gate / up / down names of an expert)
MOE_ARCHITECTURES: Dict[str, Tuple[str, Tuple[str, str, str]]] = {
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen2MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
# Every architecture scores experts with a softmax over the router logits.
ROUTER_SCORE = "softmax"

Rows = List[Tuple[str, int, int]]  # (HF name, lo, hi) along the concatenation dim


def moe_fields(cfg: Dict[str, Any], arch: str, source: str, need: Callable) -> Dict[str, Any]:
    """The ModelSpec MoE fields of an HF config (``need(key)``: a positive integer or a
    ConfigError): ``num_experts``, ``moe_ffn_hidden_size``, ``moe_topk``,
    ``moe_pre_softmax`` (top-k probabilities not renormalised: Qwen3-MoE's and Qwen2-MoE's
    ``norm_topk_prob=false``), ``moe_shared_ffn_hidden_size`` (Qwen2-MoE's shared expert).
    {} for a dense architecture. Refuses what the table would map wrongly: dense layers
    between MoE ones, router jitter."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    experts, topk = need(key), need("num_experts_per_tok")
    if topk > experts:
        raise ConfigError(f"{source}: num_experts_per_tok={topk} > {key}={experts}")
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ConfigError(
                f"{source}: mlp_only_layers={cfg.get('mlp_only_layers')!r} / "
                f"decoder_sparse_step={cfg.get('decoder_sparse_step')!r}: dense layers "
                "between MoE layers are not supported (every layer MoE only)"
            )
        return dict(
            num_experts=experts,
            moe_ffn_hidden_size=need("moe_intermediate_size"),
            moe_topk=topk,
            moe_pre_softmax=not cfg.get("norm_topk_prob", False),
            **(
                {"moe_shared_ffn_hidden_size": need("shared_expert_intermediate_size")}
                if arch == "Qwen2MoeForCausalLM"
                else {}
            ),
        )
    jitter = cfg.get("router_jitter_noise") or 0.0
    if jitter:
        raise ConfigError(
            f"{source}: router_jitter_noise={jitter!r}: transformers multiplies the router "
            "input by noise while training; only 0 is supported"
        )
    return dict(
        num_experts=experts,
        moe_ffn_hidden_size=need("intermediate_size"),
        moe_topk=topk,
        moe_pre_softmax=False,
    )


def check_megatron_router(spec: Any) -> None:
    """ConfigError for a router megatron-core cannot build: top-1 with the selected score
    renormalised (Qwen3-MoE / Qwen2-MoE ``norm_topk_prob=true``, Mixtral at k = 1: a weight of
    1, no router gradient), which megatron-core refuses ("Please use --moe-router-pre-softmax
    when topk is 1", 0.16.1 ``transformer/transformer_config.py:1633-1641``). The top-1 with
    the full softmax's score megatron-core wants is another forward (the expert's output
    scaled by p < 1), so it is not mapped there silently."""
    if spec.num_experts and spec.moe_topk == 1 and not spec.moe_pre_softmax:
        raise ConfigError(
            f"{spec.architecture}: num_experts_per_tok=1 with the routing weight renormalised "
            "(norm_topk_prob=true, or Mixtral) is refused by megatron-core (it wants the "
            "softmax score of all experts at top-1); use the HF backend (model.backend=hf)"
        )


def moe_transformer_fields(spec: Any) -> Dict[str, Any]:
    """The megatron-core ``TransformerConfig`` fields that describe ``spec``'s MoE layers ({} when
    dense): E experts of width F', softmax scores, top-k renormalised unless
    ``moe_router_pre_softmax``, Qwen2-MoE's shared expert behind its sigmoid gate (None / False
    without one). What the Megatron backend builds and what ``hf-to-megatron-lm`` records."""
    if not spec.num_experts:
        return {}
    check_megatron_router(spec)
    return dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_topk,
        moe_router_score_function=ROUTER_SCORE,
        moe_router_pre_softmax=spec.moe_pre_softmax,
        # Qwen2-MoE's shared expert: sigmoid(gate_weight . x) * SwiGLU(x), as transformers
        moe_shared_expert_intermediate_size=spec.moe_shared_ffn_hidden_size or None,
        moe_shared_expert_gate=bool(spec.moe_shared_ffn_hidden_size),
    )


def expert_count(spec: Any, ep: int) -> int:
    """Experts per EP rank (the layout check has made E divisible by EP)."""
    return spec.num_experts // ep


def is_expert_param(name: str) -> bool:
    """Whether Megatron parameter ``name`` is an expert's (split over EP x ETP, reduced
    over the expert-data-parallel group) rather than a dense one."""
    return ".mlp.experts." in name


def moe_local_names(spec: Any, layout: Any, prefix: str) -> List[str]:
    """The MoE block's parameter names of one layer (``prefix`` = "decoder.layers.j."), in
    ``named_parameters`` order: the router, then the local experts."""
    n = expert_count(spec, layout.ep)
    names = [prefix + "mlp.router.weight"]
    if layout.te:
        names += [prefix + f"mlp.experts.linear_fc{i}.weight{k}" for i in (1, 2) for k in range(n)]
    else:
        names += [
            prefix + f"mlp.experts.local_experts.{k}.linear_fc{i}.weight"
            for k in range(n)
            for i in (1, 2)
        ]
    if spec.moe_shared_ffn_hidden_size:  # built after the experts (MoELayer.__init__)
        names += [prefix + f"mlp.shared_experts.{x}" for x in SHARED_LOCAL]
    return names


# A shared expert's parameters, in ``named_parameters`` order (MLP's, then SharedExpertMLP's
# gate), and its HF tensors in transformers' order.
SHARED_LOCAL = ("linear_fc1.weight", "linear_fc2.weight", "gate_weight")
SHARED_HF = (
    "shared_expert.gate_proj.weight",
    "shared_expert.up_proj.weight",
    "shared_expert.down_proj.weight",
    "shared_expert_gate.weight",
)


def swiglu_rows(
    pre: str, names: Tuple[str, str, str], width: int, split: int, rank: int, fc: int
) -> Tuple[int, Rows]:
    """(concatenation dim, HF rows) of a SwiGLU MLP's ``linear_fc1`` (``fc`` 1: rank
    ``rank``'s rows of the gate, then of the up projection) or ``linear_fc2`` (``fc`` 2: its
    columns of the down projection), the ``width`` split over ``split`` ranks; ``names``:
    the (gate, up, down) HF names after ``pre``. The dense MLP (over TP), each expert (over
    ETP) and a shared expert (over TP) split this way."""
    gate, up, down = names
    f = width // split
    lo, hi = rank * f, (rank + 1) * f
    if fc == 1:
        return 0, [(pre + f"{gate}.weight", lo, hi), (pre + f"{up}.weight", lo, hi)]
    return 1, [(pre + f"{down}.weight", lo, hi)]


def _shared_parts(rest: str, hf: str, spec: Any, layout: Any) -> Optional[Tuple[int, Rows]]:
    """(concatenation dim, HF rows) of a shared-expert parameter, split over TP as the dense
    MLP is (the gate replicated); None for any other name."""
    if not rest.startswith("mlp.shared_experts."):
        return None
    leaf = rest[len("mlp.shared_experts.") :]
    p = hf + "mlp."
    if leaf == "gate_weight":
        return 0, [(p + "shared_expert_gate.weight", 0, 1)]
    fc = {"linear_fc1.weight": 1, "linear_fc2.weight": 2}.get(leaf)
    if fc is None:
        return None
    names = tuple(f"shared_expert.{x}" for x in ("gate_proj", "up_proj", "down_proj"))
    return swiglu_rows(p, names, spec.moe_shared_ffn_hidden_size, layout.tp, layout.tp_rank, fc)


def _expert_of(rest: str) -> Optional[Tuple[int, int]]:
    """(local expert k, fc 1 or 2) of a layer-relative expert name, or None."""
    parts = rest.split(".")
    if parts[:3] == ["mlp", "experts", "local_experts"] and len(parts) == 6:
        return int(parts[3]), int(parts[4][-1])
    if parts[:2] == ["mlp", "experts"] and len(parts) == 4 and parts[3].startswith("weight"):
        return int(parts[3][len("weight") :]), int(parts[2][-1])
    return None


def moe_local_parts(rest: str, hf: str, spec: Any, layout: Any) -> Optional[Tuple[int, Rows]]:
    """(concatenation dim, HF rows) of layer-relative name ``rest`` of layer ``hf``
    ("model.layers.i.") at ``layout``, or None when ``rest`` is not a MoE parameter."""
    if not spec.num_experts:
        return None
    block, (gate, up, down) = MOE_ARCHITECTURES[spec.architecture]
    if rest == "mlp.router.weight":
        return 0, [(hf + f"{block}.gate.weight", 0, spec.num_experts)]
    if spec.moe_shared_ffn_hidden_size:
        shared = _shared_parts(rest, hf, spec, layout)
        if shared is not None:
            return shared
    which = _expert_of(rest)
    if which is None:
        return None
    k, fc = which
    e = layout.ep_rank * expert_count(spec, layout.ep) + k
    pre = hf + f"{block}.experts.{e}."
    return swiglu_rows(
        pre, (gate, up, down), spec.moe_ffn_hidden_size, layout.etp, layout.etp_rank, fc
    )


def moe_hf_names(spec: Any, layer: int) -> List[str]:
    """The MoE block's HF tensors of layer ``layer``, in transformers' order."""
    block, (gate, up, down) = MOE_ARCHITECTURES[spec.architecture]
    p = f"model.layers.{layer}.{block}."
    names = [p + "gate.weight"]
    for e in range(spec.num_experts):
        names += [p + f"experts.{e}.{x}.weight" for x in (gate, up, down)]
    if spec.moe_shared_ffn_hidden_size:
        names += [p + x for x in SHARED_HF]
    return names


def moe_hf_shape(hf_name: str, spec: Any) -> Optional[Tuple[int, ...]]:
    """The shape of a MoE HF tensor of ``spec``; None for any other tensor."""
    if not spec.num_experts:
        return None
    block, (gate, up, down) = MOE_ARCHITECTURES[spec.architecture]
    H, F, Fs = spec.hidden_size, spec.moe_ffn_hidden_size, spec.moe_shared_ffn_hidden_size
    if hf_name.endswith(f".{block}.gate.weight"):
        return (spec.num_experts, H)
    if Fs and f".{block}.shared_expert" in hf_name:
        leaf = hf_name.rsplit(".", 2)[-2]
        shapes = {
            "gate_proj": (Fs, H),
            "up_proj": (Fs, H),
            "down_proj": (H, Fs),
            "shared_expert_gate": (1, H),
        }
        return shapes.get(leaf)
    if f".{block}.experts." not in hf_name:
        return None
    leaf = hf_name.rsplit(".", 2)[-2]
    if leaf in (gate, up):
        return (F, H)
    if leaf == down:
        return (H, F)
    return None


def fused_target(name: str) -> Optional[Tuple[str, Optional[int], Optional[int]]]:
    """Where checkpoint tensor ``name`` lives in transformers 5's in-memory MoE modules, which
    fuse the experts (``mlp.experts.gate_up_proj`` [E, 2F', H]: gate rows then up rows;
    ``mlp.experts.down_proj`` [E, H, F']) and call every router ``mlp.gate``: (parameter
    name, expert or None, 0 gate / 1 up half or None); None for a tensor of no MoE block."""
    for block, (gate, up, down) in MOE_ARCHITECTURES.values():
        layer, sep, rest = name.partition(f".{block}.")
        if not sep:
            continue
        if rest == "gate.weight":
            return f"{layer}.mlp.gate.weight", None, None
        parts = rest.split(".")
        if len(parts) != 4 or parts[0] != "experts" or parts[3] != "weight":
            return None
        e, leaf = int(parts[1]), parts[2]
        if leaf == down:
            return f"{layer}.mlp.experts.down_proj", e, None
        if leaf in (gate, up):
            return f"{layer}.mlp.experts.gate_up_proj", e, int(leaf == up)
    return None
