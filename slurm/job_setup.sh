# shellcheck shell=bash
# The training scripts' shared start (train_dp.sbatch and train_megatron.sbatch source it
# with the script's arguments, from $REPO_DIR, before anything runs): the Hydra overrides
# are checked, the environment knobs get their defaults and are checked, and the rendezvous
# is chosen. Every check fails with one error line and exit 2, before any srun.
#
# Expects: REPO_DIR, SLURM_JOB_ID, SLURM_JOB_NODELIST (sbatch sets the last two).
# Sets: GPUS_PER_NODE NNODES OUTPUT_DIR DEVICE PYTHON MAX_REQUEUES RESTART_COUNT, and exports
# MASTER_ADDR MASTER_PORT.
# shellcheck disable=SC2034  # the variables are the caller's

# The run folder is the script's OUTPUT_DIR: it reads it back (the dry run's plan, the stop
# marker that decides a requeue), so an output_dir= override would split the run in two.
for arg in "$@"; do
    if [[ "$arg" =~ ^\+{0,2}output_dir= ]]; then
        echo "error: $arg: set the run folder with OUTPUT_DIR=... (an environment variable of this script), not an output_dir= override" >&2
        exit 2
    fi
done

GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
NNODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
# The job id survives a requeue, so a requeued run finds its own checkpoints here.
OUTPUT_DIR="${OUTPUT_DIR:-$REPO_DIR/outputs/slurm-$SLURM_JOB_ID}"
DEVICE="${DEVICE:-cuda}"
PYTHON="${PYTHON:-python}"
MAX_REQUEUES="${MAX_REQUEUES:-20}"
RESTART_COUNT="${SLURM_RESTART_COUNT:-0}"

# Numbers the arithmetic and torchrun need, checked here so a typo is one error line.
for knob in GPUS_PER_NODE NNODES; do
    if [[ ! "${!knob}" =~ ^[1-9][0-9]*$ ]]; then
        echo "error: $knob=${!knob} is not a whole number >= 1" >&2
        exit 2
    fi
done
for knob in MAX_REQUEUES RESTART_COUNT; do
    if [[ ! "${!knob}" =~ ^[0-9]+$ ]]; then
        echo "error: $knob=${!knob} is not a whole number >= 0" >&2
        exit 2
    fi
done
# SELFCHECK=true or yes used to skip the self-check without a word: only 1 runs it.
if [[ ! "${SELFCHECK:-0}" =~ ^[01]?$ ]]; then
    echo "error: SELFCHECK=$SELFCHECK must be 1 (run the self-check first) or 0 / unset (skip it)" >&2
    exit 2
fi
if [[ -n "${MASTER_PORT:-}" && ! "$MASTER_PORT" =~ ^[0-9]+$ ]]; then
    echo "error: MASTER_PORT=$MASTER_PORT is not a port number" >&2
    exit 2
fi
if [[ -z "${SLURM_JOB_NODELIST:-}" ]]; then
    echo "error: SLURM_JOB_NODELIST is not set (not started by sbatch?): the first node hosts the rendezvous" >&2
    exit 2
fi
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${#nodes[@]} == 0 )); then
    echo "error: scontrol show hostnames $SLURM_JOB_NODELIST named no node" >&2
    exit 2
fi
MASTER_ADDR="${nodes[0]}"
# Several jobs may share a node: spread the rendezvous ports by job id.
MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
export MASTER_ADDR MASTER_PORT
