"""Parallelism applied from outside the model: mesh, parallelize() in a fixed order, the engines, the planner."""
