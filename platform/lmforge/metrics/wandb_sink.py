"""Weights & Biases sink (rank 0 only; other ranks get no sinks at all, see ``MetricsLogger``).

- ``logging.wandb.mode``: ``online`` | ``offline`` | ``disabled``. ``online`` needs an API key and a reachable
  server; without either we fall back to ``offline`` with ONE warning instead of hanging (online init with no
  network blocks ~100 s): the key is looked up in ``WANDB_API_KEY`` / ``~/.netrc`` and the server
  (``WANDB_BASE_URL`` or api.wandb.ai) is probed with one 3 s HTTP(S) request before ``wandb.init``.
- project / entity / group / tags / name come from config; the group defaults to ``run.sweep_name`` so the
  points of a sweep are grouped.
- The config is logged with secrets redacted; no console capture, no code/git/requirements upload and no
  metadata file (it would carry ``sys.argv``, where a pasted key would leak).
- The run id is chosen before ``wandb.init`` (or taken from the checkpoint sidecar on resume) and the run is
  opened with ``resume="allow"``, so a restarted or requeued job continues the same W&B run.
- ``tokens_seen`` and ``flops_seen`` are defined as x-axes: train and eval series step on ``tokens_seen``
  by default; ``flops_seen`` is logged in the same rows for scaling-law plots (loss vs compute).
"""

from __future__ import annotations

import netrc
import sys
from pathlib import Path
from typing import Mapping, Optional, Tuple
from urllib.parse import urlparse

from lmforge.config.logging import WandbConfig
from lmforge.runtime.env_vars import environment
from lmforge.runtime.secrets import redact

DEFAULT_BASE_URL = "https://api.wandb.ai"
PROBE_TIMEOUT_S = 3.0


def api_key_present(env: Mapping[str, str], host: str) -> bool:
    if env.get("WANDB_API_KEY"):
        return True
    try:
        path = Path(env.get("NETRC") or Path(env.get("HOME", str(Path.home()))) / ".netrc")
        return path.is_file() and netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def server_reachable(base_url: str, timeout: float = PROBE_TIMEOUT_S) -> Tuple[bool, str]:
    """One HTTP(S) request to the server with a short timeout. Any HTTP answer over a verified connection counts
    as reachable; DNS failure, refusal, silence (timeout) or a TLS certificate that is not the server's (an
    intercepting proxy) do not. A bare TCP connect is not enough: intercepting proxies accept every connect."""
    import urllib.error
    import urllib.request

    parsed = urlparse(base_url)
    where = f"{parsed.hostname}:{parsed.port or (80 if parsed.scheme == 'http' else 443)}"
    try:
        with urllib.request.urlopen(urllib.request.Request(base_url, method="GET"), timeout=timeout):
            return True, where
    except urllib.error.HTTPError:  # the server answered (401/404/...): it is there
        return True, where
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return False, f"{where} ({type(reason).__name__}: {str(reason)[:160]})"


def resolve_mode(
    requested: str, env: Optional[Mapping[str, str]] = None, timeout: float = PROBE_TIMEOUT_S
) -> Tuple[str, Optional[str]]:
    """The mode to use and, if it differs from the request, the one warning to print."""
    env = environment() if env is None else env
    if requested != "online":
        return requested, None
    base_url = env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL
    host = urlparse(base_url).hostname or "api.wandb.ai"
    if not api_key_present(env, host):
        return "offline", (
            f"logging.wandb.mode=online but no W&B API key (WANDB_API_KEY or ~/.netrc for {host}); "
            f"logging offline instead. Sync later with `wandb sync <run dir>/wandb/offline-run-*`"
        )
    ok, where = server_reachable(base_url, timeout)
    if not ok:
        return "offline", (
            f"logging.wandb.mode=online but the W&B server {where} is unreachable; logging offline "
            f"instead. Sync later with `wandb sync <run dir>/wandb/offline-run-*`"
        )
    return "online", None


def new_run_id() -> str:
    import secrets

    return secrets.token_hex(4)


class WandbSink:
    """``wandb_dir`` is the run directory's ``wandb/`` folder (``RunPaths.wandb``); runs land in
    ``wandb/offline-run-*`` or ``wandb/run-*`` (wandb.init(dir=) appends the ``wandb`` itself)."""

    def __init__(
        self,
        cfg: WandbConfig,
        wandb_dir: Path,
        config: dict,
        run_id: Optional[str] = None,
        group: Optional[str] = None,
        mode: Optional[str] = None,
        warn=None,
    ):
        import wandb

        self.requested = cfg.mode
        if mode is None:
            mode, message = resolve_mode(cfg.mode)
            if message:
                (warn or _warn)(message)
        self.mode = mode
        self.run_id = run_id or new_run_id()
        self._last_step = 0
        self._event_counts: dict = {}
        wandb_dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            console="off",
            save_code=False,
            disable_code=True,
            disable_git=True,
            x_disable_meta=True,
            x_save_requirements=False,
            x_disable_stats=True,
            init_timeout=60.0,
            silent=True,
        )
        kwargs = dict(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group or group,
            tags=list(cfg.tags) or None,
            name=cfg.name,
            id=self.run_id,
            resume="allow",
            dir=str(wandb_dir.parent),
            config=redact(config),
            settings=settings,
        )
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as e:  # noqa: BLE001 - e.g. online init failing after the probe succeeded
            if mode != "online":
                raise
            (warn or _warn)(f"W&B online init failed ({type(e).__name__}: {str(e)[:200]}); logging offline instead")
            self.mode = "offline"
            self.run = wandb.init(mode="offline", **kwargs)
        self.run.define_metric("tokens_seen")
        self.run.define_metric("flops_seen")
        for pattern in ("train/*", "val/*", "eval/*", "tokens/*", "checkpoint/*"):  # eval/*: downstream tasks
            self.run.define_metric(pattern, step_metric="tokens_seen")

    def log(self, record: dict) -> None:
        kind = record.get("kind", "train")
        row = {}
        for key, value in record.items():
            if key in ("kind", "time", "step") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if key in ("tokens_seen", "flops_seen") or key.startswith(("val/", "eval/", "tokens/")):
                row[key] = value
            else:
                row[f"{kind}/{key}"] = value
        if row:
            self._last_step = max(self._last_step, int(record.get("step", self._last_step)))
            self.run.log(row, step=self._last_step)

    def event(self, record: dict) -> None:
        name = str(record.get("event", ""))
        self._last_step = max(self._last_step, int(record.get("step", 0)))  # never step backwards
        if name.startswith("checkpoint"):
            row = {
                f"checkpoint/{k}": v
                for k, v in record.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time", "rank")
            }
            if row:
                self.run.log(row, step=self._last_step)
            return
        # Fault and lifecycle events (restart, requeue, preemption checkpoint, skipped step, straggler, watchdog):
        # a counter series per event and, when the run is online, a W&B alert naming rank, step and cause.
        self._event_counts[name] = self._event_counts.get(name, 0) + 1
        self.run.log({f"events/{name}": self._event_counts[name]}, step=self._last_step)
        if self.mode == "online":
            text = f"rank {record.get('rank')} step {record.get('step')}: {record.get('cause', '')}"
            try:
                import wandb

                self.run.alert(title=f"lmforge: {name}", text=text[:1000], level=wandb.AlertLevel.WARN)
            except Exception as e:  # noqa: BLE001 - an alert must never stop training
                _warn(f"W&B alert for '{name}' failed: {type(e).__name__}")

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _warn(message: str) -> None:
    print(f"lmforge: warning: {message}", file=sys.stderr, flush=True)


def make_wandb_sink(
    cfg: WandbConfig, wandb_dir: Path, *, config: dict, run_id: Optional[str], group: Optional[str] = None
) -> Optional[WandbSink]:
    """A sink for ``cfg.mode`` (None when disabled). Call on rank 0 only."""
    if cfg.mode == "disabled":
        return None
    return WandbSink(cfg, wandb_dir, config, run_id=run_id, group=group)
