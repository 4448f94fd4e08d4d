"""The one exception type for bad configuration: it always names the key, the reason and the fix."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem found before any compute is spent.

    The message has three parts a user can act on: which key, why it is wrong, and how to fix it.
    """

    def __init__(self, key: str, reason: str, fix: str = ""):
        self.key = key
        self.reason = reason
        self.fix = fix
        msg = f"config key '{key}': {reason}"
        if fix:
            msg += f". Fix: {fix}"
        super().__init__(msg)
