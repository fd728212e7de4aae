"""slurm/network_env.sh, which both sbatch scripts source before any rank starts: the
interface gloo binds (GLOO_SOCKET_IFNAME, the model-parallel gloo twin spans nodes) and NCCL's
NVLink SHARP switch (NCCL_NVLS_ENABLE, whose buffers the dry run counts) reach the ranks."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

SLURM = Path(__file__).resolve().parents[1] / "slurm"


def _sourced(**env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_"))}
    probe = (
        f"set -euo pipefail; source {SLURM / 'network_env.sh'}; "
        "bash -c 'echo \"gloo=${GLOO_SOCKET_IFNAME-unset} nvls=${NCCL_NVLS_ENABLE-unset}\"'"
    )
    r = subprocess.run(
        ["bash", "-c", probe], env={**base, **env}, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize(
    "env,child",
    [
        ({}, "gloo=unset nvls=unset"),
        ({"GLOO_SOCKET_IFNAME": "ib0"}, "gloo=ib0 nvls=unset"),
        ({"NCCL_SOCKET_IFNAME": "eth0,eth1"}, "gloo=eth0,eth1 nvls=unset"),  # gloo reads a list
        ({"NCCL_SOCKET_IFNAME": "^lo,docker"}, "gloo=unset nvls=unset"),  # NCCL-only syntax
        ({"NCCL_SOCKET_IFNAME": "=eth0"}, "gloo=unset nvls=unset"),
        ({"GLOO_SOCKET_IFNAME": "ib1", "NCCL_SOCKET_IFNAME": "eth0"}, "gloo=ib1 nvls=unset"),
        ({"NCCL_NVLS_ENABLE": "0"}, "gloo=unset nvls=0"),
    ],
)
def test_the_ranks_inherit_gloos_interface_and_the_nvls_switch(env, child):
    lines = _sourced(**env)
    assert lines[-1] == child
    assert lines[0].startswith("network: gloo on ")
    assert ("NCCL NVLS 0" in lines[0]) == (env.get("NCCL_NVLS_ENABLE") == "0")


@pytest.mark.parametrize("script", ["train_megatron.sbatch", "train_dp.sbatch"])
def test_both_scripts_source_it_before_any_rank_starts(script):
    text = (SLURM / script).read_text()
    at = text.index('source "$REPO_DIR/slurm/network_env.sh"')
    first_srun = re.search(r"^(if ! )?srun ", text, re.M).start()
    assert at < first_srun and at < text.index('source "$REPO_DIR/slurm/selfcheck_step.sh"')
