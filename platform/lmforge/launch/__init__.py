"""Launchers: local torchrun (``lmforge launch``), Slurm submission (slurm/train.sh, submitit), job control."""
