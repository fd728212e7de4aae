"""``D3SGRPOTrainer``: TRL's ``GRPOTrainer`` with D3S / PODS down-sampling in its step.

Where it hooks TRL 1.16.0 (``trl/trainer/grpo_trainer.py``; range in ``nemo_d3s/versions.py``):

- ``_calculate_rewards`` (l.1579) returns the whole batch's rewards, gathered over processes
  (l.1681); the override keeps them.
- ``_generate_and_score_completions`` (l.2324) returns this process's batch (``output``, l.2898)
  with TRL's advantages over groups ``rewards.view(-1, G)`` (l.2765), sliced per process (l.2813).
  The override gathers the advantages and runs one core sample selection over the whole batch on
  every process, scores the kept rows' tokens with TRL's own
  ``_get_per_token_logps_and_entropies(compute_entropy=True)`` (l.1419, l.1501) for the DP-global
  |A| x H top-K, and cuts the batch to the kept rows. The token selection travels as ``tool_mask``,
  which only the loss mask reads (l.3027); ``num_items_in_batch`` (l.2498, the ``dapo`` / ``cispo``
  denominator, l.3170) is recounted on the kept tokens.
- ``_prepare_inputs`` (l.1522) splits the cut batch into ``steps_per_generation`` micro-batches
  (``split_tensor_dict`` drops a remainder, l.1544), so ``kept_batch`` pads each process to a
  multiple with zero-loss rows, to the same rows on every process (the most any kept): TRL
  gathers per-row metrics in the loss (l.3280-3282), whose shapes must agree; generation
  (and D3S) runs once per ``steps_per_generation * num_iterations`` micro-steps (l.1538) and
  the buffered cut batches are reused (l.1546), ``old_per_token_logps`` (l.2643) cut like
  every key.
- ``_compute_loss`` (l.3020) gets each training micro-batch compacted (``compact_rows``): rows
  without a kept token dropped, except for the loss types that count rows (grpo, sapo, dr_grpo,
  luspo), and padded back with zero-loss rows to the most any process keeps; completion
  columns after the last kept token dropped (vespo with a per-token vLLM ratio keeps them to
  the last completion token). Not with an MoE router loss.

Preset ``grpo`` returns the batch untouched; evaluation batches are never cut. ``dapo``, ``cispo``
and ``vespo`` divide by ``num_items_in_batch`` (l.3168), so placeholders add 0; ``grpo``, ``sapo``,
``bnpo``, ``dr_grpo``, ``luspo`` (l.3153-3180) and the entropy bonus (l.3189) average per
micro-batch, which unequal kept rows skew: refused when a preset drops rollouts with
``steps_per_generation > 1`` or several processes.

vLLM generation is not run with the plugin (the CPU vLLM 0.32 here is outside TRL 1.16's 0.22-0.31).
By TRL's source it only replaces the generator in ``_generate_single_turn`` (l.1767); rewards
(l.2753) and advantages (l.2765) come from the hooked body, and server and colocate mode both keep
the process-major layout with G consecutive rollouts per prompt
(``trl/generation/vllm_generation.py`` l.593-657, l.661-747). ``kept_batch`` cuts vLLM's
``sampling_per_token_logps``, ``old_per_token_logps`` and ``importance_sampling_ratio``
(l.2660-2707). The entropy pass uses the training model, as TRL's old-logp pass does, over as
many rows on every process (sharded models all-gather their parameters in each forward)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist
import trl
from trl import GRPOTrainer

from nemo_d3s.core.presets import PRESETS, D3SConfig
from nemo_d3s.core.sample_selection import SAMPLE_SELECTORS
from nemo_d3s.errors import ConfigError
from nemo_d3s.integrations.trl.selection import (
    ROW_COUNTING_LOSSES,
    TRLD3SSelector,
    compact_rows,
    kept_batch,
    step_shares,
)
from nemo_d3s.versions import check_stack

__all__ = ["D3SGRPOTrainer", "resolve_d3s"]

# TRL's loss types whose normaliser is the micro-batch's own rows or tokens, not the
# recounted ``num_items_in_batch`` (grpo_trainer.py l.3153-3180).
MICRO_BATCH_MEAN_LOSSES = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")


def resolve_d3s(d3s: Union[str, D3SConfig, Mapping, None]) -> D3SConfig:
    """A preset name (the Hydra ``d3s=`` options), a D3SConfig or a mapping of its fields ->
    D3SConfig; ConfigError listing the presets for an unknown name."""
    if d3s is None:
        d3s = "d3s"
    if isinstance(d3s, str):
        if d3s not in PRESETS:
            raise ConfigError(f"d3s={d3s!r}: unknown preset; known: {', '.join(sorted(PRESETS))}")
        return D3SConfig.from_preset(d3s)
    if isinstance(d3s, D3SConfig):
        return d3s
    if isinstance(d3s, Mapping):
        try:
            return D3SConfig.from_mapping(d3s)
        except ValueError as e:
            raise ConfigError(f"d3s: {e}") from None
    raise ConfigError(
        f"d3s must be a preset name, a D3SConfig or a mapping, got {type(d3s).__name__}"
    )


def _dp_group() -> Optional[dist.ProcessGroup]:
    """TRL's processes are accelerate's: the default group (None for one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


class D3SGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer(..., d3s="d3s")``: TRL's arguments plus ``d3s`` (preset name, ``D3SConfig`` or
    mapping) and ``compact`` (cut each micro-batch after its last kept token before the loss's
    forward: ``compact_rows``). Progress is ``global_step / (max_steps - 1)``, as in
    ``nemo_d3s.train``; logs the ``d3s/*`` shares, N, K, advantage variances, placeholder rows and
    ``d3s/forward_token_share`` (the loss forward's tokens after compaction / before)."""

    def __init__(
        self,
        *args: Any,
        d3s: Union[str, D3SConfig, Mapping, None] = "d3s",
        compact: bool = True,
        **kwargs,
    ):
        # one line, or a warning under NEMO_D3S_ALLOW_UNTESTED=1 (nemo_d3s/versions.py)
        check_stack(["trl"], {"trl": trl.__version__})
        self.d3s_config = resolve_d3s(d3s)
        super().__init__(*args, **kwargs)
        cfg = self.d3s_config
        self._d3s_keeps_all = bool(SAMPLE_SELECTORS.prop(cfg.sample_rule, "keeps_all"))
        # The MoE router's auxiliary loss averages over every attended token: not compacted.
        self.d3s_compact = bool(compact) and not self.aux_loss_enabled
        self._d3s_selector: Optional[TRLD3SSelector] = None
        self._d3s_rewards: Optional[torch.Tensor] = None
        if self.top_entropy_quantile < 1.0 and TRLD3SSelector(cfg, None).needs_entropy:
            raise ConfigError(
                f"top_entropy_quantile={self.top_entropy_quantile}: TRL's entropy mask and D3S's "
                "|A| x H token selection would both cut tokens; set top_entropy_quantile=1.0"
            )
        self._refuse_uneven_means()
        self._refuse_pods_mismatch()
        try:  # pods keeping one rollout per prompt: every kept advantage is 0
            cfg.check_group_size(int(self.num_generations))
        except ValueError as e:
            raise ConfigError(
                f"d3s.schedule.{e} (num_generations={self.num_generations})"
            ) from None

    def _refuse_uneven_means(self) -> None:
        """ConfigError for a per-micro-batch mean (loss type or entropy bonus) that a preset
        dropping rollouts would skew (``kept_batch`` pads with zero-loss rows)."""
        spg, procs = int(self.args.steps_per_generation), int(self.accelerator.num_processes)
        if self._d3s_keeps_all or (spg == 1 and procs == 1):
            return
        where = f"steps_per_generation={spg}, {procs} process(es)"
        if self.loss_type in MICRO_BATCH_MEAN_LOSSES:
            raise ConfigError(
                f"loss_type={self.loss_type!r} with {where}: it averages over each micro-batch, "
                "which D3S leaves holding unequal kept rollouts (padded with zero-loss rows); use "
                "loss_type='dapo' (TRL's default), 'cispo' or 'vespo', or d3s='grpo'"
            )
        if self._entropy_bonus_enabled:
            raise ConfigError(
                f"entropy_coef={self.entropy_coef} with {where}: TRL's entropy bonus averages over "
                "each micro-batch, which D3S leaves holding unequal kept rollouts; set "
                "entropy_coef=0.0 and use_adaptive_entropy=False, or steps_per_generation=1 on "
                "one process"
            )

    def _refuse_pods_mismatch(self) -> None:
        """ConfigError for TRL advantage settings PODS would silently replace: PODS
        re-normalises the kept rollouts' summed rewards with the preset's ``advantage``
        estimator, which is TRL's ``scale_rewards="group"`` (``grpo``, both with std + 1e-4 at
        PODS' eps) or ``"none"`` (``dr_grpo``) under ``sum_then_normalize`` only."""
        cfg = self.d3s_config
        if not SAMPLE_SELECTORS.prop(cfg.sample_rule, "renormalises"):
            return
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ConfigError(
                f"d3s pods with multi_objective_aggregation={self.multi_objective_aggregation!r}: "
                "PODS re-normalises the kept rollouts' weighted reward sum, which is "
                "'sum_then_normalize'; use that, or another preset"
            )
        matches = {"group": "grpo", "none": "dr_grpo"}
        want = matches.get(self.scale_rewards)
        if want != cfg.advantage:
            fix = (
                f"d3s={{..., 'advantage': '{want}'}}" if want else "scale_rewards='group' or 'none'"
            )
            raise ConfigError(
                f"d3s pods re-normalises the kept rollouts' rewards with advantage="
                f"{cfg.advantage!r}, which is not TRL's scale_rewards={self.scale_rewards!r} "
                f"(group: 'grpo', none: 'dr_grpo'); use {fix}"
            )

    @property
    def d3s_selector(self) -> TRLD3SSelector:
        if self._d3s_selector is None:  # built on first use: the process group exists by then
            self._d3s_selector = TRLD3SSelector(self.d3s_config, _dp_group())
        return self._d3s_selector

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        # [B_total, n_funcs] gathered over processes; the weighted sum is TRL's reward.
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        self._d3s_rewards = rewards
        return rewards_per_func

    def _d3s_progress(self) -> float:
        total = int(self.state.max_steps or 1)
        return min(1.0, max(0.0, self.state.global_step / max(1, total - 1)))

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return output
        return self._d3s_cut(output)

    def _compute_loss(self, model, inputs):
        cut = self.model.training and "tool_mask" in inputs and self._d3s_cuts
        if not (cut and self.d3s_compact):
            return super()._compute_loss(model, inputs)
        compacted, before, after = compact_rows(
            inputs,
            drop_rows=self.loss_type not in ROW_COUNTING_LOSSES,
            ratio_columns=self.loss_type != "vespo",
            multiple=self.pad_to_multiple_of,
            # every process's micro-batch holds as many rows (TRL gathers per-row metrics)
            equal_rows=self._most_over_processes,
        )
        self._metrics["train"]["d3s/forward_token_share"].append(after / max(before, 1))
        return super()._compute_loss(model, compacted)

    @property
    def _d3s_cuts(self) -> bool:
        """Whether the preset cuts TRL's batch (``grpo`` hands it on untouched)."""
        return not (self._d3s_keeps_all and not self.d3s_selector.needs_entropy)

    def _most_over_processes(self, n: int) -> int:
        """The largest ``n`` over TRL's processes (one all-gather; ``n`` itself on one)."""
        if self.accelerator.num_processes == 1:
            return int(n)
        counts = self.accelerator.gather(torch.tensor([int(n)], device=self.accelerator.device))
        return int(counts.max())

    @torch.no_grad()
    def _d3s_entropy(
        self, output: Mapping[str, Any], rows: torch.Tensor, forward_rows: int
    ) -> torch.Tensor:
        """[B_kept, C] f32 on the CPU: old-policy entropy of the kept rows' completion tokens, one
        no-grad pass over those rows padded with copies of row 0 to ``forward_rows`` (the most
        any process kept): every process runs as many forwards, which sharded training
        (FSDP, ZeRO-3: a parameter all-gather per forward) needs; the copies' values are
        dropped."""
        if forward_rows == 0:
            return torch.zeros(0, output["completion_ids"].shape[1])
        n = int(rows.numel())
        rows = torch.cat([rows, rows.new_zeros(forward_rows - n)])
        dev_rows = rows.to(output["completion_ids"].device)
        ids = torch.cat([output["prompt_ids"][dev_rows], output["completion_ids"][dev_rows]], 1)
        attn = torch.cat([output["prompt_mask"][dev_rows], output["completion_mask"][dev_rows]], 1)
        _, entropy, _ = self._get_per_token_logps_and_entropies(
            self.model,
            ids,
            attn,
            output["completion_ids"].shape[1],
            batch_size=self.args.per_device_train_batch_size,
            compute_entropy=True,
        )
        return entropy[:n].detach().float().cpu()

    def _d3s_cut(self, output: Dict[str, Any]) -> Dict[str, Any]:
        sel = self.d3s_selector
        progress = self._d3s_progress()
        b_local = int(output["completion_ids"].shape[0])
        process = self.accelerator.process_index
        advantages_all = self.accelerator.gather(output["advantages"]).detach().cpu()
        rewards_all = self._d3s_rewards.detach().cpu()
        mine = slice(process * b_local, (process + 1) * b_local)
        stage, keep_all = sel.select_whole(
            rewards_all, advantages_all, self.num_generations, mine, progress
        )
        response = output["completion_mask"].bool()
        if output.get("tool_mask") is not None:
            response = response & output["tool_mask"].bool()
        response = response.cpu()
        rows = stage.kept_rows
        # the most rows a process kept, from the whole batch's selection every process holds
        # (process p's rows are [p B, (p + 1) B)): its passes and cut batch, alike everywhere
        most = int(keep_all.view(-1, b_local).sum(dim=1).max())
        entropy = self._d3s_entropy(output, rows, most) if sel.needs_entropy else None
        tokens = sel.select_tokens(stage, entropy, response[rows], progress)
        counts = torch.tensor(
            [float(response.sum()), float(tokens.token_keep.sum())], dtype=torch.float64
        )
        eligible_all, kept_all = sel.reduce_sums(counts).tolist()
        if not self._d3s_cuts:
            cut, n_pad = output, 0  # grpo: TRL's batch untouched
        else:
            batch = dict(output)
            batch["advantages"] = stage.advantages.to(output["advantages"].device)
            cut, n_pad = kept_batch(
                batch,
                rows,
                tokens.token_keep,
                min_rows=int(self.args.steps_per_generation),
                trim_columns=self.pad_to_multiple_of is None,
                rows_over_processes=most,
            )
            loss_mask = cut["completion_mask"] * cut["tool_mask"]
            cut["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        shares = step_shares(keep_all.numel(), int(keep_all.sum()), eligible_all, kept_all)
        metrics = self._metrics["train"]
        for key, value in shares.items():
            metrics[f"d3s/{key}"].append(value)
        metrics["d3s/n_keep"].append(float(stage.n_keep))
        metrics["d3s/k_frac"].append(float(tokens.k_frac))
        metrics["d3s/kept_adv_var"].append(stage.metrics["kept_adv_var"])
        metrics["d3s/adv_var_all"].append(stage.metrics["adv_var_all"])
        pads = self.accelerator.gather(torch.tensor([float(n_pad)], device=self.accelerator.device))
        metrics["d3s/placeholder_rows"].append(float(pads.sum()))
        return cut
