"""Errors that tell the user what is wrong, why, and how to fix it."""
from __future__ import annotations


class ActionableError(ValueError):
    """``<subject>: <reason>. Fix: <fix>`` — the shape of every user-facing error in lmforge."""

    def __init__(self, subject: str, reason: str, fix: str = ""):
        self.reason = reason
        self.fix = fix
        msg = f"{subject}: {reason}"
        if fix:
            msg += f". Fix: {fix}"
        super().__init__(msg)


class ConfigError(ActionableError):
    """A configuration problem found before any compute is spent; names the config key."""

    def __init__(self, key: str, reason: str, fix: str = ""):
        self.key = key
        super().__init__(f"config key '{key}'", reason, fix)
