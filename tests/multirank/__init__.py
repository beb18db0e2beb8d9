"""Tests that start processes: gloo ranks (spawn_ranks), the tools' command lines, torchrun / SLURM
launches, with the rank-side scripts they run beside them."""
