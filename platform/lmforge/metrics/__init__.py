"""Metrics: throughput/MFU meters and sinks (console, JSONL, Weights & Biases), chosen by config."""
