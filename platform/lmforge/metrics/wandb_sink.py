"""Weights & Biases sink (rank 0 only; other ranks get no sinks at all, see ``MetricsLogger``).

- ``logging.wandb.mode``: ``auto`` (default) | ``online`` | ``offline`` | ``disabled``. ``auto`` follows W&B's
  own ``WANDB_MODE`` when it is set (the test suite sets ``disabled``); otherwise it is ``online`` when an API
  key is found (``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, ``~/.netrc`` or W&B's settings file) and
  ``offline`` when none is, announced in one line with the ``wandb sync`` command. ``online`` needs an API key
  and a reachable server; without either we fall back to ``offline`` with ONE warning instead of hanging
  (online init with no network blocks ~100 s): the server (``WANDB_BASE_URL`` or api.wandb.ai) is probed with
  one 3 s HTTP(S) request before ``wandb.init``.
- project / entity / group / tags / name come from config; the group defaults to ``run.sweep_name`` so the
  points of a sweep are grouped, and a sweep point's N, D and C (``run.sweep_*``) are in the run config as
  ``sweep.N``, ``sweep.D``, ``sweep.C``.
- The config is logged with secrets redacted; no console capture, no code/git/requirements upload and no
  metadata file (it would carry ``sys.argv``, where a pasted key would leak).
- The run id is chosen before ``wandb.init`` (or taken from the checkpoint sidecar on resume) and the run is
  opened with ``resume="allow"``, so a restarted or requeued job continues the same W&B run.
- Steps: every row carries the trainer's step as ``trainer/step``, the x-axis of every series
  (``define_metric("*", step_metric="trainer/step")``); rows are logged without ``step=``, so W&B's own step only
  counts rows and never goes backwards. A resumed launch logs the redone steps (below the last step the
  previous launch logged) and its ``resume`` event as new rows instead of W&B dropping them.
  ``tokens_seen`` and ``flops_seen`` are in the same rows: the second x-axis (loss vs tokens or compute).
"""

from __future__ import annotations

import configparser
import importlib.util
import netrc
import sys
from pathlib import Path
from typing import Mapping, Optional, Tuple
from urllib.parse import urlparse

from lmforge.config.errors import ActionableError, ConfigError
from lmforge.config.logging import WandbConfig
from lmforge.metrics.run_summary import wandb_line
from lmforge.metrics.series import EventCounter, record_row
from lmforge.runtime.env_vars import environment
from lmforge.runtime.secrets import redact, redact_text

DEFAULT_BASE_URL = "https://api.wandb.ai"
PROBE_TIMEOUT_S = 3.0
STEP_METRIC = "trainer/step"
# WANDB_MODE's values (W&B's own names, ``dryrun`` and ``run`` included) -> the mode they mean.
WANDB_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline", "disabled": "disabled"}


def server_host(env: Mapping[str, str]) -> str:
    """The W&B server's host name (``WANDB_BASE_URL``, default api.wandb.ai): what ~/.netrc is looked up for."""
    return urlparse(env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).hostname or "api.wandb.ai"


def api_key_present(env: Mapping[str, str], host: str) -> bool:
    """Whether W&B would find credentials: the key or identity-token variable, a ~/.netrc entry for ``host``, or
    an ``api_key`` in W&B's settings file. Only presence is checked; the value is never read into lmforge."""
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    home = Path(env.get("HOME") or str(Path.home()))
    try:
        path = Path(env.get("NETRC") or home / ".netrc")
        if path.is_file() and netrc.netrc(str(path)).authenticators(host) is not None:
            return True
    except (OSError, netrc.NetrcParseError):
        pass
    settings = configparser.ConfigParser(interpolation=None)
    try:
        settings.read(Path(env.get("WANDB_CONFIG_DIR") or home / ".config" / "wandb") / "settings")
    except (OSError, configparser.Error):
        return False
    return bool(settings.get("default", "api_key", fallback=""))


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


def mode_from_env(env: Mapping[str, str]) -> Optional[str]:
    """The mode W&B's own ``WANDB_MODE`` names (None when unset); a value W&B does not know is refused."""
    value = (env.get("WANDB_MODE") or "").strip().lower()
    if value and value not in WANDB_MODES:
        raise ActionableError(
            "environment variable WANDB_MODE",
            f"'{value}' is not a W&B mode (logging.wandb.mode=auto follows it)",
            f"set it to one of {', '.join(sorted(WANDB_MODES))} or unset it",
        )
    return WANDB_MODES.get(value)


def resolve_mode(
    requested: str,
    env: Optional[Mapping[str, str]] = None,
    timeout: float = PROBE_TIMEOUT_S,
    sync_path: str = "<run dir>/wandb/offline-run-*",
) -> Tuple[str, Optional[str]]:
    """The mode to use and the one line to print about it (None when the mode is the one asked for).
    ``sync_path`` is what the line names in its ``wandb sync`` command."""
    env = environment() if env is None else env
    sync = f"Sync later with `wandb sync {sync_path}`"
    base_url = env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL
    host = server_host(env)
    asked = f"logging.wandb.mode={requested}"
    if requested == "auto":
        from_env = mode_from_env(env)
        if from_env:
            requested, asked = from_env, f"logging.wandb.mode=auto with WANDB_MODE={env.get('WANDB_MODE')}"
            if requested == "offline":
                return "offline", f"W&B logging offline ({asked}). {sync}"
        elif not api_key_present(env, host):
            return "offline", (
                f"W&B logging offline ({asked} and no W&B API key: WANDB_API_KEY or ~/.netrc for {host}; "
                f"`wandb login` stores one). {sync}"
            )
        else:
            requested = "online"
    if requested != "online":
        return requested, None
    if not api_key_present(env, host):
        return "offline", (
            f"warning: {asked} but no W&B API key (WANDB_API_KEY or ~/.netrc for {host}); "
            f"logging offline instead. {sync}"
        )
    ok, where = server_reachable(base_url, timeout)
    if not ok:
        return "offline", f"warning: {asked} but the W&B server {where} is unreachable; logging offline instead. {sync}"
    return "online", None


def new_run_id() -> str:
    import secrets

    return secrets.token_hex(4)


def sweep_config(config: Mapping) -> Optional[dict]:
    """A sweep point's ``sweep`` block of the W&B run config: name, point, N (parameters), D (tokens), C (FLOPs)."""
    run = config.get("run") or {}
    if not run.get("sweep_name"):
        return None
    block = {
        "name": run.get("sweep_name"),
        "point": run.get("sweep_point"),
        "N": run.get("sweep_params"),
        "D": run.get("sweep_tokens"),
        "C": run.get("sweep_flops"),
    }
    return {k: v for k, v in block.items() if v is not None}


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

        say = warn or _say
        self.requested = cfg.mode
        self.run_id = run_id or new_run_id()
        if mode is None:
            mode, message = resolve_mode(cfg.mode, sync_path=f"{wandb_dir}/offline-run-*-{self.run_id}*")
            if message:
                say(message)
        self.mode = mode
        self._events = EventCounter()
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
        run_config = redact(config)
        sweep = sweep_config(config)
        if sweep:
            run_config["sweep"] = redact(sweep)
        kwargs = dict(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group or group,
            tags=list(cfg.tags) or None,
            name=cfg.name,
            id=self.run_id,
            resume="allow",
            dir=str(wandb_dir.parent),
            config=run_config,
            settings=settings,
        )
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as e:  # noqa: BLE001 - e.g. online init failing after the probe succeeded
            if mode != "online":
                raise
            say(
                f"warning: W&B online init failed ({type(e).__name__}: {str(e)[:200]}); logging offline instead. "
                f"Sync later with `wandb sync {wandb_dir}/offline-run-*-{self.run_id}*`"
            )
            self.mode = "offline"
            self.run = wandb.init(mode="offline", **kwargs)
        if self.mode == "online" and cfg.mode == "auto":
            say(f"W&B logging online (logging.wandb.mode=auto found an API key): {self.run.url}")
        define_axes(self.run)

    def location(self) -> str:
        """Where the rows go, as the console's start block says it: the run's URL online, its directory offline."""
        if self.mode == "online":
            return wandb_line("online", url=self.run.url)
        return wandb_line("offline", offline_dir=str(Path(self.run.dir).parent))  # run.dir is <sync dir>/files

    def describe(self, info: dict) -> None:
        """The launch's layout, size, plan and versions (``run_summary.run_info``) in the run's config and summary
        under ``run_info``; a resumed launch's values replace the earlier launch's."""
        self.run.config.update({"run_info": redact(info)}, allow_val_change=True)
        self.run.summary["run_info"] = redact(info)

    def log(self, record: dict) -> None:
        row = record_row(record)  # metrics/series.py: the names TensorBoard gets too
        if row:
            self._log(row, record)

    def _log(self, row: dict, record: dict) -> None:
        """One row at the record's trainer step; W&B numbers the rows itself (no ``step=``: see the module doc)."""
        if "step" in record:
            row[STEP_METRIC] = int(record["step"])
        self.run.log(row)

    def event(self, record: dict) -> None:
        # Checkpoint events: their numbers (checkpoint/*). Fault and lifecycle events (restart, requeue, preemption
        # checkpoint, skipped step, straggler, watchdog): a counter series per event (metrics/series.py) and, when
        # the run is online, a W&B alert naming rank, step and cause.
        name = str(record.get("event", ""))
        row = self._events.row(record)
        if row:
            self._log(row, record)
        if name.startswith("checkpoint"):
            return
        if self.mode == "online":
            text = f"rank {record.get('rank')} step {record.get('step')}: {record.get('cause', '')}"
            try:
                import wandb

                self.run.alert(title=f"lmforge: {name}", text=text[:1000], level=wandb.AlertLevel.WARN)
            except Exception as e:  # noqa: BLE001 - an alert must never stop training
                _say(f"warning: W&B alert for '{name}' failed: {type(e).__name__}")

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def define_axes(run) -> None:
    """``trainer/step`` is every series' x-axis; ``tokens_seen`` and ``flops_seen`` (in the same rows) the second."""
    run.define_metric(STEP_METRIC)
    run.define_metric("*", step_metric=STEP_METRIC)
    for axis in ("tokens_seen", "flops_seen"):
        run.define_metric(axis, step_metric=STEP_METRIC, summary="max")


def _say(message: str) -> None:
    print(f"lmforge: {redact_text(message)}", file=sys.stderr, flush=True)


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def make_wandb_sink(
    cfg: WandbConfig, wandb_dir: Path, *, config: dict, run_id: Optional[str], group: Optional[str] = None
) -> Optional[WandbSink]:
    """A sink for ``cfg.mode`` (None when disabled, or when ``auto`` resolves to disabled). Call on rank 0 only."""
    if cfg.mode == "disabled":
        return None
    if not wandb_installed():
        if cfg.mode == "auto" and mode_from_env(environment()) == "disabled":
            return None
        if cfg.mode == "auto":
            _say("W&B logging off: the wandb package is not installed (logging.wandb.mode=auto)")
            return None
        raise ConfigError(
            "logging.wandb.mode",
            f"is {cfg.mode} but the wandb package is not installed",
            "pip install wandb, or set logging.wandb.mode=disabled",
        )
    run_id = run_id or new_run_id()
    mode, message = resolve_mode(cfg.mode, sync_path=f"{wandb_dir}/offline-run-*-{run_id}*")
    if mode == "disabled":
        return None
    if message:
        _say(message)
    return WandbSink(cfg, wandb_dir, config, run_id=run_id, group=group, mode=mode)
