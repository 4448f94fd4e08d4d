"""Downstream evaluation: lm-eval-format tasks scored by log-likelihood (in the loop and offline), bits per byte.

tasks (task files), scoring (requests -> log-likelihoods -> acc/acc_norm), bytes (bits per byte), runner (the
trainer's hook over the Engine contract), offline (a checkpoint in one process), build_tasks (the shipped tasks).
"""
