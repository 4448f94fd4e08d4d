"""The one error type of the scaling package: what is wrong, why, and how to fix it."""
from __future__ import annotations


class ScalingError(ValueError):
    """Bad sweep input or data that cannot be fitted. The message names the item, the reason and the fix."""

    def __init__(self, what: str, reason: str, fix: str = ""):
        self.what = what
        self.reason = reason
        self.fix = fix
        msg = f"{what}: {reason}"
        if fix:
            msg += f". Fix: {fix}"
        super().__init__(msg)
