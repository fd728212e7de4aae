# shellcheck shell=bash
# Sourced by slurm/train_megatron.sbatch and slurm/train_dp.sbatch: the network settings every
# rank inherits (sbatch exports the submitting shell's variables; these pass them on).
#
# Gloo carries the model-parallel group's twin (the rollout ranks' waits, each refit bucket's
# agreement), which spans nodes when a model copy does (the 70B recipes: 16 GPUs on two nodes).
# Gloo binds the address the node's hostname resolves to, on some clusters an interface the
# nodes cannot reach each other on; GLOO_SOCKET_IFNAME names the one to use (ib0, eth0, or a
# comma list). Unset, a plain NCCL_SOCKET_IFNAME (no ^ or = prefix, which gloo does not read)
# is taken. SELFCHECK=1's cluster.gloo_across_nodes builds such a group across the nodes.
nccl_only_syntax='^[=^]'  # NCCL's "^" (exclude) and "=" (exact) prefixes
if [[ -z "${GLOO_SOCKET_IFNAME:-}" && -n "${NCCL_SOCKET_IFNAME:-}" && ! "$NCCL_SOCKET_IFNAME" =~ $nccl_only_syntax ]]; then
    GLOO_SOCKET_IFNAME="$NCCL_SOCKET_IFNAME"
fi
if [[ -n "${GLOO_SOCKET_IFNAME:-}" ]]; then
    export GLOO_SOCKET_IFNAME
fi
# NVLink SHARP: NCCL uses it on NVSwitch nodes unless NCCL_NVLS_ENABLE=0, at 256 MiB per rank
# for each communicator spanning 8 GPUs of a node. The dry run reads the same variable: its
# nvls term is there while NVLS is on (nemo_d3s/dry_run/memory.py).
if [[ -n "${NCCL_NVLS_ENABLE:-}" ]]; then
    export NCCL_NVLS_ENABLE
fi
gloo_on="${GLOO_SOCKET_IFNAME:-the interface of each node hostname (GLOO_SOCKET_IFNAME unset)}"
nvls="${NCCL_NVLS_ENABLE:-on where the nodes support it (NCCL_NVLS_ENABLE unset)}"
echo "network: gloo on $gloo_on, NCCL NVLS $nvls"
