"""Benchmarks: named cases measured side by side in one invocation, reported as medians and ratios."""
