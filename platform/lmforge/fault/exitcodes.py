"""Exit codes a worker uses to tell its launcher *why* it stopped (read by lmforge.fault.retry).

    0   finished, or stopped cleanly after a preemption checkpoint under torchrun (see signals.py)
    2   bad input (config, layout, data): do NOT retry, fix the input (verdict in <run>/verdicts)
    42  preemption checkpoint written: requeue me (plain ``srun python -m lmforge.train``)
    43  watchdog: no heartbeat within the timeout (stacks in <run>/dumps): restart me
    44  orphaned: my launcher died: nothing to restart here, the launcher's own failure handling decides
    45  diverged: too many non-finite / spiking losses in a row: do NOT retry, a human must look
    46  repeated crash: the same step crashed in an earlier attempt too: do NOT retry (tracebacks in <run>/crashes)
    47  corrupted: data-parallel replicas hold different weights (silent data corruption, fault/consistency.py):
        do NOT retry on the same hosts; requeued without the hosts the check names (lmforge.fault.retry), else
        check the named ranks' hardware and resume from the referenced checkpoint

Under torchrun the worker's code is lost (the agent exits 1), so every worker ending in error also writes its
verdict (lmforge.fault.verdict); lmforge.launch.agent exits with the deciding verdict's code.
"""

from lmforge.fault.signals import REQUEUE_EXIT_CODE

BAD_INPUT_EXIT_CODE = 2
WATCHDOG_EXIT_CODE = 43
ORPHAN_EXIT_CODE = 44
DIVERGED_EXIT_CODE = 45
REPEATED_CRASH_EXIT_CODE = 46
CORRUPTED_EXIT_CODE = 47

__all__ = [
    "BAD_INPUT_EXIT_CODE",
    "REQUEUE_EXIT_CODE",
    "WATCHDOG_EXIT_CODE",
    "ORPHAN_EXIT_CODE",
    "DIVERGED_EXIT_CODE",
    "REPEATED_CRASH_EXIT_CODE",
    "CORRUPTED_EXIT_CODE",
]
