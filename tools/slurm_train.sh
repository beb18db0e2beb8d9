#!/usr/bin/env bash
# Train on a SLURM cluster: one task per GPU, started by srun; each task reads its rank from SLURM's environment
# (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_NUM_TASKS; see visiondist/launch/slurm.py), so neither torchrun
# nor a wrapper is needed. Arguments are tools/train.py's:
#
#   sbatch tools/slurm_train.sh model=vit_huge parallel=tp4 data=imagenet data.root=/data/imagenet
#
# Submit from the repository root (sbatch runs a copy of this script, in the directory it was submitted from).
# Tensor-parallel groups are neighbouring ranks, and srun numbers the tasks of a node contiguously, so with
# --ntasks-per-node a multiple of parallel.tp every TP group stays inside a node (NVLink); data- and
# pipeline-parallel groups span the nodes. The run directory is fixed per job, and SIGTERM two minutes before the
# time limit makes every rank write a checkpoint: `sbatch --requeue` (or resubmitting with the same
# trainer.run_dir) continues from it.
#
#SBATCH --job-name=visiondist
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@120
#SBATCH --output=%x-%j.out
set -euo pipefail

# The first node hosts the rendezvous; the port is derived from the job id so that two jobs sharing a node differ.
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)}
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export MASTER_ADDR MASTER_PORT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-8}}
RUN_DIR=${RUN_DIR:-outputs/slurm/${SLURM_JOB_ID}}

cd "${SLURM_SUBMIT_DIR:-.}"
# --kill-on-bad-exit: a failing rank ends the step at once instead of leaving its peers waiting on a collective.
srun --kill-on-bad-exit=1 python tools/train.py trainer.run_dir="${RUN_DIR}" trainer.resume=auto "$@"
