"""Scaling-law sweeps: IsoFLOP grids (plan), running them (run), gathering losses (collect),
Chinchilla Approach 2 and 3 fits with bootstrap intervals, compute-optimal predictions, and plots.

See docs/scaling-laws.md for the method, formulas and assumptions.
"""
