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

    def __reduce__(self):
        # Picklable whatever a subclass's __init__ takes: torch.distributed (DCP's planners, all_gather_object)
        # sends a failure's exception to the other ranks by pickling it.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls, args, state):
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class ConfigError(ActionableError):
    """A configuration problem found before any compute is spent; names the config key."""

    def __init__(self, key: str, reason: str, fix: str = ""):
        self.key = key
        super().__init__(f"config key '{key}'", reason, fix)
