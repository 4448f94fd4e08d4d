"""Job control for slurm/train.sh: the Python half of the batch script (one Hydra compose per call).

prep=$(python -m lmforge.launch.jobctl prepare -- <hydra overrides>) || exit $?; eval "$prep"
    checks the job before any worker starts, with its real allocation, and exits 2 with one line on
    stderr when it cannot run: cluster.nodes against SLURM_NNODES (which sets it when not given), the
    device contract (lmforge.runtime.device_contract), the layout for world size = nodes x
    gpus_per_node (mesh product, divisibility, batch arithmetic, memory fit), GPUs and CPUs the
    allocation has against what the config needs (lmforge.launch.allocation); then prints ``export``
    lines: LMFORGE_RUN_DIR, LMFORGE_NPROC_PER_NODE, LMFORGE_MAX_RESTARTS, LMFORGE_MAX_REQUEUES,
    LMFORGE_JOB_OVERRIDES (for train.sh to append to the overrides: ``cluster.nodes=N`` from the allocation when
    not given, ``run.name=null`` when the run name comes from a preset, so the job writes its own slurm-<jobid>)
    and the comm preset's environment; records a ``requeued`` event on a requeued run
    (SLURM_RESTART_COUNT > 0); moves the previous attempt's verdicts to
    history
python -m lmforge.launch.jobctl after --exit-code RC [--signalled] -- <hydra overrides>
    decides done / requeue / stop (lmforge.fault.retry: a deterministic verdict stops), prints the decision
    (``done``, ``requeue`` or ``stop <exit code>``, the code the batch script exits with) and on ``requeue``
    requeues the job with the nodes at fault of this allocation (lmforge.fault.bad_nodes: unhealthy in Slurm, the
    host of a replica the replica check found corrupt, or flagged as a straggler fault.exclude_straggler_flags times)
    excluded from its next run (a corrupted verdict whose hosts are all excluded is requeued, not stopped)
    (lmforge.launch.node_exclusion), recorded in <run>/excluded_nodes.json and requeues.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from lmforge.config.errors import ConfigError
from lmforge.fault import bad_nodes
from lmforge.fault.events import FaultEvents
from lmforge.fault.retry import annotate_last, last_step, load_state, record, record_slurm_requeue
from lmforge.fault.verdict import archive
from lmforge.launch.allocation import NODES_KEY, check_allocation, explicit_nodes, nodes_override, run_name_override
from lmforge.launch.node_exclusion import requeue_excluding, requeued_by_slurm
from lmforge.launch.slurm_queue import hostnames, unhealthy_nodes
from lmforge.runtime.device_contract import DeviceContractError
from lmforge.runtime.device_contract import check as check_device_contract
from lmforge.runtime.env_vars import environment, read, slurm_job_id, slurm_restart_count
from lmforge.runtime.rundir import RunPaths, resolve_run_dir


def _compose(overrides: Sequence[str]):
    from lmforge.config.compose import compose  # deferred: imports omegaconf; this module imports without it
    from lmforge.config.validate import validate  # deferred: imports omegaconf; this module imports without it

    return validate(compose(list(overrides)))


def run_dir_for(cfg) -> Path:
    return resolve_run_dir(cfg.run.root, cfg.run.name, cfg.run.sweep_point)


def launch_env(cfg, run_dir: Optional[Path] = None, nproc: Optional[int] = None) -> Dict[str, str]:
    """What the batch script (and launchers/common.sh's prepare) exports before torchrun, for ``nproc`` workers a
    node (default ``cluster.gpus_per_node``). ``OMP_NUM_THREADS`` is always set, to the threads each worker pins
    (``runtime.hardware.threads_per_process``: ``train.threads``, else this node's CPUs / ``nproc``), so torchrun
    does not set it to 1 with its banner."""
    from lmforge.runtime.hardware import threads_per_process  # deferred: imports torch; this module imports without it

    nproc = cfg.cluster.gpus_per_node if nproc is None else nproc
    env = {str(k): str(v) for k, v in cfg.comm.env.items()}
    env.update(
        {
            "LMFORGE_RUN_DIR": str(run_dir_for(cfg) if run_dir is None else run_dir),
            "LMFORGE_NPROC_PER_NODE": str(nproc),
            "LMFORGE_MAX_RESTARTS": str(cfg.fault.max_restarts),
            "LMFORGE_MAX_REQUEUES": str(cfg.cluster.max_requeues),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": str(threads_per_process(cfg.train.threads, nproc)),
        }
    )
    return env


def check_job(overrides: Sequence[str], env: Mapping[str, str]):
    """Every check a job passes before srun starts a worker; returns (typed config, the overrides the job adds).

    ``trainer.startup.check_start``, the checks of every training start, for this job's world and writing nothing:
    validate(), then this job's own checks (the device contract where the job runs, the memory fit, the
    allocation), then the entry checks in the job's run dir (the task files, train.resume's checkpoint against this
    model and tokenizer, a requeued job's too, and the planned tokens against the mixture's shards already there:
    data.max_epochs). Raises ConfigError / DeviceContractError (exit 2 in ``main``)."""
    from lmforge.config.compose import compose  # deferred: imports omegaconf; this module imports without it
    from lmforge.config.validate import (
        planned_world_size,  # deferred: imports omegaconf; this module imports without it
    )
    from lmforge.trainer.startup import check_start  # deferred: imports torch; this module imports without it

    extra = nodes_override(overrides, env)
    composed = compose(list(overrides) + ([extra] if extra else []))
    unnamed = run_name_override(overrides, env, composed.run.name)
    if unnamed:  # the preset's run name is not this job's: its own slurm-<jobid> directory, said in one line
        print(
            f"lmforge: run.name={composed.run.name} comes from the config's presets, not the command line: this "
            f"Slurm job writes its own run directory (slurm-{env.get('SLURM_JOB_ID')}); give run.name=... on the "
            "command line to resume or share a named run",
            file=sys.stderr,
            flush=True,
        )
        composed = compose(list(overrides) + [o for o in (extra, unnamed) if o])
    checked = check_start(
        composed,
        world_size=planned_world_size(composed),
        run_dir=run_dir_for,
        job_checks=lambda cfg: job_checks(cfg, env),
    )
    return checked.validated, [o for o in (extra, unnamed) if o]


def job_checks(cfg, env: Mapping[str, str]) -> None:
    """What only a job can check: the device contract on this node, the memory per device, the allocation."""
    from lmforge.parallel.planner import (  # deferred: imports torch; this module imports without it
        check_fits,
        make_plan,
    )

    c = cfg.cluster
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    check_device_contract(
        cfg.train.device,
        c.name,
        c.device,
        c.gpus_per_node,
        env=env,
        where=f"node {node} (job {env.get('SLURM_JOB_ID', '-')} prepare)",
    )
    world = c.nodes * c.gpus_per_node
    check_fits(make_plan(cfg, world, peak=1.0))  # memory per device; the peak only matters for step time
    check_allocation(cfg, env)


def cmd_prepare(overrides: Sequence[str]) -> int:
    cfg, extra = check_job(overrides, environment())
    env = launch_env(cfg)
    env["LMFORGE_JOB_OVERRIDES"] = " ".join(extra)  # for train.sh to append (cluster.nodes=N, run.name=null)
    run_dir = Path(env["LMFORGE_RUN_DIR"])
    RunPaths(run_dir).make()

    restart = slurm_restart_count()
    if restart > 0:  # a run Slurm requeued by itself (node failure) left no record: write it now
        previous = heartbeat_hosts(run_dir)
        record_slurm_requeue(run_dir, run=restart - 1, nodes=previous, unhealthy=unhealthy_nodes(previous))
    archive(run_dir)  # a new job attempt: only its own verdicts decide it
    from lmforge.data.index_build import build_for  # deferred: imports numpy; this module imports without it

    build_for(cfg)  # every megatron-core index, built here before any rank waits in a collective
    if restart > 0:
        nodes = hostnames(read("SLURM_JOB_NODELIST", ""))
        check_shrink(run_dir, len(nodes))
        left_out = sorted(bad_nodes.excluded(run_dir))
        FaultEvents(RunPaths(run_dir).metrics, rank=-1).emit(
            "requeued",
            last_step(run_dir),
            f"job {slurm_job_id()} run {restart + 1} starts on {','.join(nodes)}"
            + (f" (excluded: {','.join(left_out)})" if left_out else ""),
            slurm_restart=restart,
            nodes=nodes,
            excluded=left_out,
        )
    print_exports(env)
    return 0


def check_shrink(run_dir: Path, nodes: int) -> None:
    """Say in one line when the last requeue asked Slurm for fewer nodes (cluster.min_nodes) and this run got others."""
    history = load_state(run_dir)["history"]
    asked = history[-1].get("next_nodes") if history else None
    if asked and nodes and asked != nodes:
        print(
            f"lmforge: the last requeue asked Slurm for {asked} nodes, this run has {nodes} (SLURM_JOB_NODELIST); "
            "it trains with the layout of its own node count",
            file=sys.stderr,
            flush=True,
        )


def heartbeat_hosts(run_dir: Path) -> List[str]:
    """The nodes the last run's ranks trained on (``<run>/heartbeats/rank*.json``), as Slurm names nodes."""
    hosts = set()
    for path in RunPaths(run_dir).heartbeats.glob("rank*.json"):
        try:
            hosts.add(bad_nodes.short_host(str(json.loads(path.read_text())["host"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(hosts)


def print_exports(env: Mapping[str, str]) -> None:
    """``export`` lines for a launch script to ``eval`` (jobctl prepare, launch.local prepare)."""
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")


def split_overrides(argv: Sequence[str]):
    """``[options...] -- [hydra overrides...]`` -> (options, overrides)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def cmd_after(exit_code: int, signalled: bool, overrides: Sequence[str], requeue: bool = True) -> int:
    cfg = _compose(overrides)
    run_dir = run_dir_for(cfg)
    nodes = hostnames(read("SLURM_JOB_NODELIST", ""))
    job = slurm_job_id()
    unhealthy = unhealthy_nodes(nodes) if job else {}
    reasons = bad_nodes.at_fault(run_dir, nodes, unhealthy, cfg.fault.exclude_straggler_flags) if job else {}
    if job and requeued_by_slurm(job):  # a node failure: Slurm requeued this run itself and is ending it
        return after_slurm_requeue(run_dir, job, exit_code, nodes, unhealthy, reasons)
    decision = record(
        run_dir,
        exit_code,
        signalled=signalled,
        max_failures=cfg.cluster.max_requeues,
        nodes=nodes,
        exclusions=reasons,
        stop_at_step=cfg.train.stop_at_step,
    )
    if decision.action != "requeue":
        reasons = {}
    why = "; ".join(f"{n}: {r}" for n, r in sorted(reasons.items()))
    print(
        f"lmforge: {decision.action}: {decision.reason}"
        + (f"; excluding {','.join(sorted(reasons))} ({why})" if reasons else ""),
        file=sys.stderr,
        flush=True,
    )
    print(decision.word(exit_code), flush=True)
    if decision.action == "requeue" and requeue and job:
        sys.stdout.flush()
        total = len(nodes) or cfg.cluster.nodes
        shrink, why_not = shrunk_node_count(overrides, environment(), total, len(reasons), cfg.cluster.min_nodes)
        if why_not:
            print(f"lmforge: the next run keeps {total} nodes: {why_not}", file=sys.stderr, flush=True)
        # Slurm ends this batch script at once; this process finishes the exclusion first (node_exclusion).
        requeue_and_exclude(run_dir, job, reasons, shrink)
    return 0


def after_slurm_requeue(
    run_dir: Path,
    job: str,
    exit_code: int,
    nodes: List[str],
    unhealthy: Mapping[str, str],
    reasons: Mapping[str, str],
) -> int:
    """The run's end when Slurm already requeued the job (node failure): record it, requeue nothing; the nodes at
    fault are still excluded (the job is pending: Slurm takes ExcNodeList now). ``unhealthy``: node -> state, as
    ``unhealthy_nodes`` read it for ``reasons``."""
    entry = record_slurm_requeue(
        run_dir,
        run=slurm_restart_count(),
        nodes=nodes,
        unhealthy=unhealthy,
        exit_code=exit_code,
        recorded_at=f"end of run {slurm_restart_count() + 1}",
    )
    if entry is not None:
        print(f"lmforge: requeue: {entry['reason']}", file=sys.stderr, flush=True)
        annotate_last(run_dir, excluded=sorted(reasons), exclusion_reasons=dict(reasons))
    print("requeue", flush=True)
    sys.stdout.flush()
    requeue_and_exclude(run_dir, job, reasons, requeue=False)
    return 0


def shrunk_node_count(
    overrides: Sequence[str], env: Mapping[str, str], total: int, excluded: int, min_nodes: int
) -> Tuple[Optional[int], str]:
    """The next run's node count when ``excluded`` nodes leave a ``total``-node job and ``cluster.min_nodes`` allows
    fewer (None: keep ``total``), and, when a shrink was allowed but cannot be done, why (one line)."""
    target = max(min_nodes, total - excluded)
    if not excluded or min_nodes <= 0 or target >= total:
        return None, ""
    added = set(env.get("LMFORGE_JOB_OVERRIDES", "").split())  # what prepare appended (cluster.nodes=<allocation>)
    given = explicit_nodes([o for o in overrides if o not in added])
    if given is not None:
        return None, f"cluster.nodes={given} is fixed on the command line (drop it to let the job shrink)"
    kept = [o for o in overrides if not NODES_KEY.match(o)]
    try:
        from lmforge.config.compose import compose  # deferred: imports omegaconf; this module imports without it
        from lmforge.config.validate import (
            planned_world_size,  # deferred: imports omegaconf; this module imports without it
            validate,  # deferred: imports omegaconf; this module imports without it
        )

        smaller = compose(kept + [f"cluster.nodes={target}"])
        validate(smaller, world_size=planned_world_size(smaller))
    except ConfigError as e:
        return None, f"the layout is not valid on {target} nodes ({e})"
    return target, ""


def requeue_and_exclude(
    run_dir: Path, job: str, reasons: Mapping[str, str], shrink: Optional[int] = None, requeue: bool = True
) -> None:
    """``scontrol requeue`` (unless Slurm did: ``requeue=False``) with ``reasons``' nodes excluded from the next run
    (and ``shrink`` nodes asked for); the outcome in one line on stderr, in ``<run>/excluded_nodes.json`` and in the
    requeue's ``requeues.json`` entry."""
    if not requeue and not reasons:
        return
    outcome = requeue_excluding(job, sorted(reasons), shrink if reasons else None, requeue=requeue)
    if reasons:
        restart = slurm_restart_count()
        bad_nodes.save(run_dir, reasons, job=job, slurm_restart=restart, applied=outcome.applied, error=outcome.error)
        annotate_last(run_dir, exclusion_applied=outcome.applied, exclusion_error=outcome.error, next_nodes=shrink)
    nodes = ",".join(sorted(reasons))
    if not outcome.requeued:
        print(f"lmforge: the job was not requeued: {outcome.error}", file=sys.stderr, flush=True)
    elif reasons and not outcome.applied:
        print(
            f"lmforge: could not exclude {nodes} from job {job}'s next run ({outcome.error}); it may run there again",
            file=sys.stderr,
            flush=True,
        )
    elif reasons:
        print(
            f"lmforge: excluded {nodes} from job {job}'s next run (Slurm ExcNodeList={','.join(outcome.exc_nodes)}; "
            f"recorded in {run_dir / bad_nodes.EXCLUSIONS_FILE})"
            + (
                f"; the next run asks for {shrink} node{'s' * (shrink > 1)} (an elastic shrink, cluster.min_nodes)"
                if shrink
                else ""
            ),
            file=sys.stderr,
            flush=True,
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m lmforge.launch.jobctl")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare")
    a = sub.add_parser("after")
    a.add_argument("--exit-code", type=int, required=True)
    a.add_argument("--signalled", action="store_true")
    a.add_argument("--no-requeue", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        try:
            return cmd_prepare(overrides)
        except (ConfigError, DeviceContractError) as e:
            print(f"lmforge: {e}", file=sys.stderr, flush=True)
            return 2
    return cmd_after(args.exit_code, args.signalled, overrides, requeue=not args.no_requeue)


if __name__ == "__main__":
    raise SystemExit(main())
