"""What the TRL plugin selected at its last cut, observed from the outside: a mixin that wraps
the selector's two public calls (``select_whole``, ``select_tokens``) for the duration of
``D3SGRPOTrainer._d3s_cut`` and keeps their inputs and results."""

from __future__ import annotations

from typing import Any, Dict


class SelectionRecorder:
    """Mixin before ``D3SGRPOTrainer``: ``last_selection`` holds the last cut's ``rewards``
    and ``advantages`` (the whole batch's), ``sample_keep_global``, ``stage``, ``progress``,
    ``entropy`` (the kept rows', None without a token stage), ``tokens`` and
    ``response_mask`` (this process's rows, [B_local, C])."""

    last_selection: Dict[str, Any] = {}

    def _d3s_cut(self, output):
        response = output["completion_mask"].bool()
        if output.get("tool_mask") is not None:
            response = response & output["tool_mask"].bool()
        record: Dict[str, Any] = {"response_mask": response.cpu()}
        sel = self.d3s_selector
        whole, tokens = sel.select_whole, sel.select_tokens

        def select_whole(*args, **kwargs):
            stage, keep = whole(*args, **kwargs)
            rewards, advantages, *_, progress = args
            record.update(
                rewards=rewards,
                advantages=advantages,
                sample_keep_global=keep,
                stage=stage,
                progress=progress,
            )
            return stage, keep

        def select_tokens(*args, **kwargs):
            kept = tokens(*args, **kwargs)
            record.update(entropy=args[1], tokens=kept)
            return kept

        sel.select_whole, sel.select_tokens = select_whole, select_tokens
        try:
            cut = super()._d3s_cut(output)
        finally:
            sel.select_whole, sel.select_tokens = whole, tokens
        self.last_selection = record
        return cut
