"""Checkpoints: DCP tensors + a JSON sidecar, committed atomically, with retention and resume resolution."""
