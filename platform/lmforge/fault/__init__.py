"""Fault handling: preemption signals, watchdog/heartbeat, stragglers, loss guard, retry budget."""
