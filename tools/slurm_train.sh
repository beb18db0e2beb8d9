#!/usr/bin/env bash
# Train on a SLURM cluster: one task per GPU, started by srun; each task reads its rank from SLURM's environment
# (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_NUM_TASKS; see visiondist/launch/slurm.py), so neither torchrun
# nor a wrapper is needed. Arguments are tools/train.py's:
#
#   sbatch tools/slurm_train.sh model=vit_huge parallel=tp4 data=imagenet data.root=/data/imagenet \
#       trainer.precision=bf16
#
# The #SBATCH lines below are defaults: sbatch's own options override them (`sbatch --nodes=4 --ntasks-per-node=4
# --gpus-per-node=4 tools/slurm_train.sh ...`); --mem=0 asks for each node's whole memory, as GPU nodes are given.
# Submit from the repository root, on a file system every node sees (sbatch runs a copy of this script in the
# directory it was submitted from; the run directory, outputs/slurm/<job id>, is relative to it), with the Python
# environment that has visiondist active (srun passes the environment on).
# Tensor-parallel groups are neighbouring ranks, and srun numbers the tasks of a node contiguously, so with
# --ntasks-per-node a multiple of parallel.tp every TP group stays inside a node (NVLink); data- and
# pipeline-parallel groups span the nodes. Each task is bound to its --cpus-per-task CPUs, which its threads and
# loader workers use (data.num_workers=-1: 11 here).
#
# Time limit: SLURM sends the tasks SIGTERM 300 s before it (--signal), every rank finishes its step and writes a
# checkpoint, the ranks exit 143, and the job requeues itself: it keeps its id, so its run directory, and
# trainer.resume=auto continues from that checkpoint. The window must hold a step and the checkpoint's write (a node's
# share of it at ~50 MB/s: `python tools/k8s.py ...` prints the same job's trainer.stop_timeout_s); raise it for larger
# models. VISIONDIST_REQUEUE=0 ends the job there instead. To continue a job that ended by hand:
# RUN_DIR=outputs/slurm/<its id> sbatch tools/slurm_train.sh <the same arguments>.
#
#SBATCH --job-name=visiondist
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail

# The first node hosts the rendezvous; the port is derived from the job id so that two jobs sharing a node differ.
# (sed reads the whole list: `head` would close the pipe early, and pipefail would end the script on scontrol's SIGPIPE)
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | sed -n 1p)}
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export MASTER_ADDR MASTER_PORT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-8}}
# srun reads --cpus-per-task from here (since Slurm 22.05 it does not inherit sbatch's)
export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-}}
RUN_DIR=${RUN_DIR:-outputs/slurm/${SLURM_JOB_ID}}

cd "${SLURM_SUBMIT_DIR:-.}"
# --kill-on-bad-exit: a failing rank ends the step at once instead of leaving its peers waiting on a collective.
status=0
srun --kill-on-bad-exit=1 python tools/train.py trainer.run_dir="${RUN_DIR}" trainer.resume=auto "$@" || status=$?
# 143: the ranks stopped on the time limit's SIGTERM (--signal reaches the tasks, not this script) with a checkpoint
# written; scancel signals this script too, which then ends before it gets here.
if [ "${status}" -eq 143 ] && [ "${VISIONDIST_REQUEUE:-1}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    echo "requeueing job ${SLURM_JOB_ID}: it continues from its checkpoint in ${RUN_DIR}"
    scontrol requeue "${SLURM_JOB_ID}"
fi
exit "${status}"
