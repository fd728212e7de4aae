# shellcheck shell=bash
# The sbatch scripts' optional self-check step (SELFCHECK=1), sourced by train_dp.sbatch and
# train_megatron.sbatch: nemo-d3s-selfcheck under one torchrun per node on every allocated
# GPU (NCCL across the nodes), before training. A failed check stops the job before training
# starts; its table is in the job log and its JSON in
# $OUTPUT_DIR/selfcheck/restart<n>/selfcheck.json.
#
# Expects the caller's NNODES, GPUS_PER_NODE, MASTER_ADDR, MASTER_PORT, OUTPUT_DIR, PYTHON,
# SLURM_JOB_ID and container_args; SETUP_CMD (exported) runs on each node first.
# SELFCHECK_ARGS: extra arguments, e.g. "--model /shared/models/Qwen2.5-7B" (default: the
# self-check's own tiny model, a few minutes at most).

run_selfcheck() {
    if [[ "${SELFCHECK:-0}" != 1 ]]; then
        return 0
    fi
    local out="$OUTPUT_DIR/selfcheck/restart${SLURM_RESTART_COUNT:-0}"
    local extra=()
    read -r -a extra <<< "${SELFCHECK_ARGS:-}"
    local launcher=(
        "$PYTHON" -m torch.distributed.run
        --nnodes="$NNODES"
        --nproc_per_node="$GPUS_PER_NODE"
        --rdzv_backend=c10d
        # Its own port and id: the training's rendezvous comes next on MASTER_PORT.
        --rdzv_endpoint="$MASTER_ADDR:$((MASTER_PORT + 1))"
        --rdzv_id="$SLURM_JOB_ID-selfcheck"
        --max_restarts=0
        -m nemo_d3s.selfcheck
        --out "$out"
        ${extra[@]+"${extra[@]}"}
    )
    # shellcheck disable=SC2016  # expanded by the per-node shell, not here
    local node_script='if [[ -n "${SETUP_CMD:-}" ]]; then eval "$SETUP_CMD" || exit 3; fi
exec "$@"'
    echo "[$(date '+%F %T')] self-check: $NNODES node(s) x $GPUS_PER_NODE rank(s), results in $out"
    # shellcheck disable=SC2154  # container_args: set by the sourcing sbatch script
    if ! srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
            ${container_args[@]+"${container_args[@]}"} \
            bash -c "$node_script" nemo-d3s-selfcheck "${launcher[@]}"; then
        echo "error: the self-check failed (its table above; $out/selfcheck.json); training was not started" >&2
        return 2
    fi
}
