"""``python -m lmforge.launch.agent <torchrun options> -m lmforge.train ...``: torchrun, with a restart policy.

torchrun (``torch.distributed.run``) restarts a failed worker group ``--max_restarts`` times whatever the
failure, and then exits 1: a config error or a divergence is retried to the budget and its exit code lost.
This is torchrun itself (same options, same elastic agent, same rendezvous) with one change: before the
agent restarts a failed group it reads the workers' verdicts (``<run>/verdicts``, lmforge.fault.verdict)
and, when one is deterministic, stops instead. The agent then ends the surviving workers at once (torchrun's
own teardown: SIGTERM, then SIGKILL), and exits with the verdict's exit code (2, 45, 46, 47) after printing its
kind, rank, step and message. Other failures keep torchrun's behaviour; the exit code is the first failed
worker's own code (1 for an uncaught exception, 43 for the watchdog) rather than torchrun's constant 1.

Why a wrapper: torch.distributed.elastic has no restart-policy hook; ``LocalElasticAgent._invoke_run``
restarts on every FAILED/UNHEALTHY state while ``_remaining_restarts > 0``. The wrapper subclasses
``LocalElasticAgent`` and sets ``_remaining_restarts`` to 0 in ``_monitor_workers`` when a deterministic
verdict exists (checked on torch 2.13 by tests/distributed/test_verdicts.py). The alternative, a worker that
exits 0 after a deterministic error so that torchrun does not restart, does not work: torchrun waits for
every worker to finish and ends the peers only on a failure, so they would block in their next collective
until its timeout, and a 0 exit would read as success.

``LMFORGE_RUN_DIR`` names the run directory (slurm/train.sh exports it via ``jobctl prepare``;
``lmforge launch`` sets it); without it the agent refuses to start. torchrun's own logs and error files go to
``<run>/torchelastic`` unless ``--log-dir`` is given (torchrun's default, a new ``/tmp/torchelastic_*`` per
launch, was never removed: 414 of them after one day of this project's tests).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from lmforge.fault.verdict import deciding
from lmforge.runtime.env_vars import read
from lmforge.runtime.file_modes import set_tree
from lmforge.runtime.rundir import RunPaths

RUN_DIR_ENV = "LMFORGE_RUN_DIR"


def agent_class(run_dir: Path):
    """A ``LocalElasticAgent`` that does not restart a group whose verdict is deterministic."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class VerdictAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._remaining_restarts > 0:
                verdict = deciding(run_dir)
                if verdict is not None:
                    print(
                        f"lmforge agent: not restarting the worker group ({self._remaining_restarts} restarts "
                        f"left): {verdict.summary()}",
                        file=sys.stderr,
                        flush=True,
                    )
                    self._remaining_restarts = 0
            return result

    return VerdictAgent


def exit_code_of(failures: dict, run_dir: Path) -> int:
    verdict = deciding(run_dir)
    if verdict is not None:
        print(f"lmforge agent: stopped: {verdict.summary()}", file=sys.stderr, flush=True)
        return verdict.exit_code
    codes = [f.exitcode for _, f in sorted(failures.items()) if f.exitcode and f.exitcode > 0]
    return codes[0] if codes else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_dir = read(RUN_DIR_ENV, "")
    if not run_dir:
        print(
            f"lmforge agent: ${RUN_DIR_ENV} is not set: the agent reads the workers' verdicts there. Fix: "
            f"export {RUN_DIR_ENV}=<the run directory> (slurm/train.sh and lmforge launch do)",
            file=sys.stderr,
        )
        return 2
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api

    api.LocalElasticAgent = agent_class(Path(run_dir))  # launch_agent() builds its agent from this name
    logs = RunPaths(Path(run_dir)).torchelastic
    if not any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in argv):
        argv = ["--log-dir", str(logs)] + argv
    try:
        torchrun.main(argv)
    except ChildFailedError as e:
        return exit_code_of(e.failures, Path(run_dir))
    finally:
        set_tree(logs)  # torchrun's files take the run directory's modes (runtime/file_modes.py)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
