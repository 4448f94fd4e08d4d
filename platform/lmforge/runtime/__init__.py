"""Process-level facts below every other layer: run directory, provenance, secrets, hardware, threads."""
