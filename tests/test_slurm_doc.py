"""slurm/README.md quotes what the scripts and the dry run say: the 70B recipe's verdict line,
each training script's SIGUSR1 lead time; and no document has an empty section."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "slurm" / "README.md"


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_healthy_log_quotes_the_70b_dry_run_verdict(monkeypatch):
    from nemo_d3s.dry_run import plan, render
    from nemo_d3s.train import compose_config

    for k in ("NNODES", "GPUS_PER_NODE", "SLURM_JOB_NUM_NODES", "SLURM_GPUS_ON_NODE"):
        monkeypatch.delenv(k, raising=False)
    out = render(plan(compose_config(["experiment=llama3_70b", "output_dir=/tmp/unused"])))
    verdict = next(line for line in out.splitlines() if line.startswith("verdict:"))
    assert f"`{verdict}`" in _flat(DOC.read_text()), verdict


@pytest.mark.parametrize("script", ["train_dp.sbatch", "train_megatron.sbatch"])
def test_preemption_section_gives_each_scripts_signal_lead_time(script):
    lead = re.search(
        r"^#SBATCH --signal=B:USR1@(\d+)$", (REPO / "slurm" / script).read_text(), re.M
    ).group(1)
    assert f"`--signal=B:USR1@{lead}` in `{script}`" in _flat(DOC.read_text())


@pytest.mark.parametrize(
    "doc",
    [
        "README.md",
        "slurm/README.md",
        "docs/evidence.md",
        "docs/design-choices.md",
        "docs/scaling.md",
        "docs/faults.md",
    ],
)
def test_no_heading_without_text_under_it(doc):
    text = (REPO / doc).read_text()
    text = re.sub(
        r"```.*?```", "", text, flags=re.S
    )  # '#' lines inside code blocks are not headings
    empty = re.findall(r"^(#{1,6} .*)\n+(?=#{1,6} |\Z)", text, re.M)
    assert not empty, empty
