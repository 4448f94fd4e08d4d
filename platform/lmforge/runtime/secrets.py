"""Keep secrets out of logs, config dumps, provenance and W&B config.

A key is secret when one of its name's parts (split at ``_ . -``) is, or ends with, one of SECRET_MARKERS
(case-insensitive): ``WANDB_API_KEY``, ``HF_TOKEN``, ``apikey`` are; ``tokenizer``, ``planned_tokens`` are not. Text is scrubbed of the
*values* of every secret environment variable too, so a key pasted into an override is caught as well.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Mapping

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "COOKIE", "PRIVATE")
REDACTED = "***REDACTED***"
_SPLIT_RE = re.compile(r"[_.\-]")
# Names that match a marker but hold no secret.
_NOT_SECRET = {"WANDB_MODE", "KEYBOARD", "XAUTHORITY"}


def is_secret_name(name: str) -> bool:
    if name.upper() in _NOT_SECRET:
        return False
    return any(part.endswith(SECRET_MARKERS) for part in _SPLIT_RE.split(name.upper()) if part)


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    return sorted({v for k, v in env.items() if is_secret_name(k) and len(v) >= 6}, key=len, reverse=True)


def redact_text(text: str, env: Mapping[str, str] | None = None) -> str:
    for value in secret_values(env):
        text = text.replace(value, REDACTED)
    return text


def redact(obj: Any, env: Mapping[str, str] | None = None) -> Any:
    """Deep copy of dicts/lists/strings with secret keys and secret values replaced."""
    if isinstance(obj, Mapping):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_name(k) and obj[k] not in (None, "") else redact(v, env))
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [redact(v, env) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj, env)
    return obj


def redacted_environ(prefixes: Iterable[str] = ()) -> dict[str, str]:
    """The process environment (optionally only names with the given prefixes), secrets redacted."""
    items = {k: v for k, v in os.environ.items() if not prefixes or k.startswith(tuple(prefixes))}
    return redact(items)
