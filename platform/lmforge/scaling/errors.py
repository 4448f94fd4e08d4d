"""The one error type of the scaling package: what is wrong, why, and how to fix it."""

from __future__ import annotations

from lmforge.config.errors import ActionableError


class ScalingError(ActionableError):
    """Bad sweep input or data that cannot be fitted. The message names the item, the reason and the fix."""

    def __init__(self, what: str, reason: str, fix: str = ""):
        self.what = what
        super().__init__(what, reason, fix)
