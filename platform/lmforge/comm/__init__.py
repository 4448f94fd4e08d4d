"""Collectives: process groups, transport environment presets, bandwidth bench, overlap measurement."""
