"""The Trainer: builds data, engine, checkpointing and metrics from a validated config and runs the loop.

Each part lives in its own module; this file only wires them and owns the loop (``fit``), where every call of a
step is named for what it does and every collective is marked "collective:":

    for step in range(start, run_steps):                 # run_steps: max_steps, or a batch ramp's (config/batch_ramp.py)
        replica_ft.start_step()                          # fault/replica_ft.py (fault.replica_ft): quorum, healing
        lr = scheduled_lr(consumed_samples)              # optim/schedule.py: by step, or by samples under a ramp
        batches = data.step_batches()                    # data/loader.py
        guard = faults.before_step(step)                 # fault/hooks.py: watchdog beat, drills -> the loss guard
        result = engine.train_step(batches, lr, guard)   # parallel/native_engine.py: the layout's collectives
        if not result.committed: continue                # replica FT: no replica committed it; redone
        faults.after_step(step); stop_on_fault()         # stragglers, replica checks; Diverged/Corrupted raised here
        log_step / evaluate                              # metrics/ (token counts all-reduced on logging steps)
        commit_checkpoint(); vote_stop()                 # checkpoint/ async commit, the preemption vote (comm/vote.py)
        maybe save a checkpoint                          # checkpoint/
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from lmforge.checkpoint.extra_state import scheduler_changes, scheduler_state
from lmforge.checkpoint.layout import latest, step_dir
from lmforge.checkpoint.manager import CheckpointManager
from lmforge.checkpoint.weights import load_model_weights
from lmforge.comm.preflight import run_preflight
from lmforge.comm.process_group import WorldInfo, init_process_group
from lmforge.comm.profiling import OverlapProbe, profile_interval
from lmforge.comm.vote import LaggedVote
from lmforge.config.batch_ramp import batch_ramp, run_steps
from lmforge.config.errors import ConfigError
from lmforge.config.record import config_dict
from lmforge.config.seq_len_warmup import seq_len_warmup
from lmforge.config.validated import Validated
from lmforge.data.loader import BatchStream
from lmforge.data.mixture import build_mixture
from lmforge.data.sources import default_cache_dir
from lmforge.data.stream_size import stream_sizes
from lmforge.evaluation.bytes import bits_per_byte, token_byte_lengths
from lmforge.evaluation.runner import TaskRunner
from lmforge.fault.goodput import GoodputError, goodput_record, summary_line, write_goodput
from lmforge.fault.goodput_ledger import GoodputLedger, run_start_time
from lmforge.fault.hooks import FaultHooks
from lmforge.fault.replica_ft import ReplicaFT
from lmforge.fault.signals import PreemptionFlag, preemption_exit_code
from lmforge.metrics.logger import MetricsLogger
from lmforge.metrics.meter import IntervalMeter, device_synchronizer
from lmforge.metrics.run_summary import (
    RunSummary,
    StartInfo,
    continue_hint,
    next_steps_line,
    run_info,
    start_block,
    wandb_line,
)
from lmforge.metrics.sinks import JsonlSink, make_console_sink
from lmforge.metrics.tensorboard_sink import TensorBoardSink
from lmforge.metrics.wandb_sink import make_wandb_sink
from lmforge.model.flops import document_flops_per_token, flops_per_token
from lmforge.model.gpt import param_count_from_config
from lmforge.optim.schedule import lr_multiplier, lr_multiplier_at
from lmforge.parallel.build_engine import build_engine
from lmforge.parallel.float8 import gap_warning
from lmforge.parallel.mesh import DIM_NAMES
from lmforge.parallel.planner import prediction_gap, run_prediction, startup_memory_check
from lmforge.runtime import env_vars, host_memory, provenance
from lmforge.runtime.device_contract import check as check_device_contract
from lmforge.runtime.dist import barrier, is_distributed
from lmforge.runtime.file_modes import make_dir, set_file, set_tree, write_text
from lmforge.runtime.hardware import peak_tflops, pin_threads, refresh_cpu_peak, select_device
from lmforge.runtime.rundir import RunPaths
from lmforge.trainer.entry_checks import EntryChecks
from lmforge.trainer.launch_record import launch_number, write_launch_record


class Preempted(SystemExit):
    verdict_kind = "preempted"  # lmforge.fault.verdict: retryable

    def __init__(self) -> None:
        super().__init__(preemption_exit_code())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Validated, run_dir: Path, checked: EntryChecks):
        """Built by ``trainer.startup.start`` (every start): ``checked`` is its ``entry_checks(cfg, prepare=True,
        run_dir=run_dir)``, whose eval tasks, tokenizer and resume point are used as they are (nothing parsed,
        loaded or resolved again)."""
        self.cfg, self.plan = cfg  # validate()'s typed config and batch plan (cfg.<group> reads the config)
        self.paths = RunPaths(Path(run_dir))
        if checked.run_dir is None or Path(checked.run_dir) != self.paths.root or checked.tokenizer is None:
            raise ValueError(
                f"the Trainer takes trainer.startup.start's entry checks (prepare=True, run_dir={run_dir}), got "
                f"run_dir={checked.run_dir}, tokenizer {'loaded' if checked.tokenizer is not None else 'not loaded'}"
            )
        eval_tasks = checked.eval_tasks  # eval.tasks: parsed (and their data read) before any process group
        self.threads = pin_threads(cfg.train.threads)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        # Before any collective: a job that wants GPUs it cannot use stops here, on every rank (exit 2).
        check_device_contract(cfg.train.device, cfg.cluster.name, cfg.cluster.device, env_vars.local_world_size())
        self.device = select_device(cfg.train.device, env_vars.local_rank())
        # Before the model and data are built: on the CPU, glibc keeps freed blocks for the next step's tensors.
        self.host_malloc = host_memory.apply(host_memory.resolve(cfg.train.host_malloc, self.device.type))
        self.world: WorldInfo = init_process_group(cfg.comm, self.device, run_dir=self.paths.root)
        self.rank = self.world.rank
        seed_everything(cfg.train.seed)
        startup_memory_check(cfg, self.device, self.rank)  # the planner's memory estimate (warning only)
        if self.rank == 0:
            self.paths.make()
        barrier()

        # Data
        cache = default_cache_dir(cfg.data, cfg.run.root)
        self.tokenizer = checked.tokenizer
        # The data index size N is fixed by the first launch's plan and read back from the checkpoint on resume.
        self.resume_point = checked.resume_point
        prior = self.resume_point.sidecar.get("data") if self.resume_point else None
        # fault.replica_ft: the stream is planned for every replica group's batch (fault/replica_ft.py)
        groups = cfg.fault.replica_groups if cfg.fault.replica_ft == "torchft" else 1
        self.num_train_samples, total_samples = stream_sizes(
            cfg.train,
            self.plan.tokens_per_step * groups,
            self.plan.global_batch_size * groups,
            cfg.model.seq_len,
            prior_state=prior,
        )
        self.mixture = build_mixture(
            cfg.data,
            self.tokenizer,
            seq_len=cfg.model.seq_len,
            seed=cfg.train.seed,
            num_train_samples=self.num_train_samples,
            num_valid_samples=cfg.train.eval_batches * self.plan.micro_batch_size * self.plan.dp_size,
            cache_dir=cache,
            total_train_samples=total_samples,
        )

        # train.batch_size_schedule: the global batch by samples consumed; the run's optimizer steps follow from it
        self.ramp = batch_ramp(cfg.train)
        self.run_steps = run_steps(cfg.train)  # train.max_steps without a ramp
        self.seq_warmup = seq_len_warmup(cfg.train, cfg.model.seq_len)  # train.seq_len_schedule (None: off)
        self.seq_len_now = 0  # the length of the last step's sequences (a change is a seq_len event)

        # Model, parallelism, optimizer
        self.engine = build_engine(cfg, self.device)
        self.data = BatchStream(
            self.mixture,
            self.plan,
            dp_rank=self.engine.dp_rank,
            device=self.device,
            num_workers=cfg.data.num_workers,
            document_masking=cfg.data.document_masking,
            loss_after_eod=cfg.data.loss_after_eod,
            batch_at=self.ramp.batch_at if self.ramp else None,
            pieces_at=self.seq_warmup.pieces_at if self.seq_warmup else None,
        )
        self.checkpoints = CheckpointManager(self.paths.checkpoints, cfg.checkpoint, self.engine)
        # Evaluation: bytes per token id (val/<source>/bpb, built at the first evaluation) and the downstream tasks
        self.token_bytes: Optional[torch.Tensor] = None
        self.tasks = (
            TaskRunner(
                eval_tasks,
                self.tokenizer.encode,
                eod=self.tokenizer.eod,
                seq_len=cfg.model.seq_len,
                batch_size=cfg.eval.batch_size,
                limit=cfg.eval.limit,
            )
            if eval_tasks
            else None
        )
        self.flops_per_token = flops_per_token(cfg.model)
        dtype = torch.bfloat16 if self.engine.precision != "fp32" else torch.float32
        say = print if self.rank == 0 else (lambda _line: None)
        if self.host_malloc.startswith("system ("):  # retain was asked for (or auto on the CPU) and is not in force
            say(f"lmforge: warning: host malloc: {self.host_malloc}")
        peak = peak_tflops(self.device, dtype, warn=say)
        refresh = (
            (lambda achieved, old: refresh_cpu_peak(dtype, achieved, peak=old, warn=say))
            if self.device.type == "cpu"
            else None
        )  # a cached CPU peak measured under contention is re-measured
        self.meter = IntervalMeter(
            self.flops_per_token,
            peak,
            self.world.world_size,
            self.plan.tokens_per_step,
            device_synchronizer(self.device),
            refresh_peak=refresh,
        )
        # the planner's figures, logged beside the measured ones (rank 0 logs; its memory model builds the GPT on
        # the meta device, a second of start-up the other ranks skip)
        self.prediction = self._predict(peak, say) if self.rank == 0 else {}
        self.prediction_warned = self.device.type != "cuda"  # a GPU run warns once when they differ by > 25%
        self.step = 0
        self.wandb_run_id: Optional[str] = None
        self.preemption = PreemptionFlag().install()
        self.faults: Optional[FaultHooks] = None  # started by fit()
        self.stop_vote: Optional[LaggedVote] = None  # "did any rank get a preemption signal?" (fit)
        self.replica_ft: Optional[ReplicaFT] = None  # fault.replica_ft=torchft: this replica group's torchft side (fit)
        self.resumed_replica_ft: Optional[dict] = None  # its Manager's state in the resumed checkpoint (maybe_resume)
        self.history: List[dict] = []
        every = profile_interval(cfg.metrics.profile_every, self.world.world_size)  # null: auto, by world size
        self.overlap = OverlapProbe(every, self.paths.traces, self.device)
        self.launch = 0  # this launch's number in the run (launches/launch-NNN.yaml; rank 0 reads it)
        self.ledger: Optional[GoodputLedger] = None  # rank 0's time ledger of this launch (fit)
        self._pending_source_tokens = [0] * len(self.mixture.sources)
        self.summary = RunSummary()  # a sink on rank 0: what the end summary reports (metrics/run_summary.py)
        self.wandb_where = ""  # the start block's W&B line (_make_logger)
        self.wandb_sink = None  # rank 0's W&B sink, when W&B logs (_make_logger)

    # ---- helpers -----------------------------------------------------------------------------------
    def _predict(self, peak: float, say) -> dict:
        """``parallel.planner.run_prediction`` for this run, or nothing (said in one line) where the planner's
        tables do not know the device."""
        try:
            return run_prediction(self.cfg, self.device, self.world.world_size, peak)
        except ConfigError as exc:
            say(f"lmforge: note: no planner prediction to log beside the measurements: {exc}")
            return {}

    def _write_run_files(self) -> None:
        """``config.yaml`` on a fresh start (or a run directory that has none), never over the config of a run
        that is resumed; this launch's record (``launches/``) always; ``provenance.json``. A ``DONE`` marker is
        removed when this launch trains a finished run further (it is written again at the new end)."""
        if self.rank != 0:
            return
        set_tree(self.paths.hydra)  # Hydra's files, written before any process group, take the run's modes
        set_file(self.paths.job_log)
        config = config_dict(self.cfg)
        if self.resume_point is None or not self.paths.config.exists():
            write_text(self.paths.config, OmegaConf.to_yaml(OmegaConf.create(config)))
        self.launch = launch_number(write_launch_record(self.paths, config, self.step, self.resume_point))
        if self.step < self.run_steps:
            self.paths.done_marker.unlink(missing_ok=True)
        layout = {
            "world_size": self.world.world_size,
            "backend": self.world.backend,
            "mesh": {k: v for k, v in zip(DIM_NAMES, self.engine.dims.shape)},
            "batch": asdict(self.plan),
            "threads": self.threads,
            "device": str(self.device),
            "host_malloc": self.host_malloc,
            "precision": self.engine.precision,
        }
        provenance.write(self.paths.provenance, provenance.collect(layout=layout))

    def _make_logger(self) -> MetricsLogger:
        if self.rank != 0:
            return MetricsLogger([], rank=self.rank)
        sinks = [make_console_sink(self.cfg.logging.console, self.run_steps, self.step), self.summary]
        if self.cfg.logging.jsonl:
            sinks.append(JsonlSink(self.paths.metrics))
        if self.cfg.logging.tensorboard:
            config_yaml = OmegaConf.to_yaml(OmegaConf.create(config_dict(self.cfg)))
            sinks.append(
                TensorBoardSink(make_dir(self.paths.tensorboard), start_step=self.step, config_yaml=config_yaml)
            )
        wandb_sink = make_wandb_sink(
            self.cfg.logging.wandb,
            self.paths.wandb,
            config=config_dict(self.cfg),
            run_id=self.wandb_run_id,
            group=self.cfg.run.sweep_name,
        )
        self.wandb_where, self.wandb_sink = wandb_line(None), wandb_sink
        if wandb_sink is not None:
            self.wandb_run_id = wandb_sink.run_id  # persisted in every checkpoint's sidecar
            self.wandb_where = wandb_sink.location()
            sinks.append(wandb_sink)
        return MetricsLogger(sinks, rank=0)

    def start_info(self, resumed: Optional[int]) -> StartInfo:
        """What the console's start block says (metrics/run_summary.py)."""
        cfg = self.cfg
        return StartInfo(
            run_dir=str(self.paths.root),
            launch=self.launch,
            resumed_from=resumed,
            model=cfg.model.name,
            parameters=param_count_from_config(cfg.model),
            precision=self.engine.precision,
            device=str(self.device),
            world_size=self.world.world_size,
            backend=self.world.backend,
            mesh=dict(zip(DIM_NAMES, self.engine.dims.shape)),
            max_steps=cfg.train.max_steps,
            last_step=min(self.run_steps, cfg.train.stop_at_step or self.run_steps),
            tokens_per_step=self.plan.tokens_per_step,
            wandb=self.wandb_where,
        )

    def sidecar(self) -> dict:
        return {
            "data": self.data.state_dict(),
            "world_size": self.world.world_size,
            "wandb_run_id": self.wandb_run_id,
            "config": config_dict(self.cfg),
            "tokenizer": self.tokenizer.identity,
            "scheduler": scheduler_state(
                self.cfg.optim,
                self.cfg.train.max_steps,
                self.step,
                self.scheduled_lr(self.data.state.consumed_samples),
            ),
            **({"replica_ft": self.replica_ft.state_dict()} if self.replica_ft is not None else {}),
        }

    def scheduled_lr(self, consumed: int) -> float:
        """The LR of the step that starts after ``consumed`` samples: by step (optim/schedule.py); under a batch
        ramp by the samples the step moves the run through, the schedule's step keys counting full batches."""
        cfg = self.cfg
        if self.ramp is None:
            return cfg.optim.lr * lr_multiplier(self.step, cfg.optim, cfg.train.max_steps)
        after, unit = consumed + self.ramp.batch_at(consumed), cfg.train.global_batch_size
        return cfg.optim.lr * lr_multiplier_at(consumed, after, unit, cfg.optim, max_steps=cfg.train.max_steps)

    def note_seq_len(self, batches) -> None:
        """Under train.seq_len_schedule: a step whose length differs from the last one's is a ``seq_len`` event (with
        parallelism.compile, dynamo's compiled graphs so far: the recompiles the lengths cost)."""
        length = batches[0].tokens.shape[1]
        if self.seq_warmup is None or length == self.seq_len_now:
            return
        self.seq_len_now = length
        fields = {}
        if self.cfg.parallelism.compile:
            fields["compiled_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        self.logger.event("seq_len", step=self.step + 1, cause=f"sequence length {length}", **fields)

    def save_checkpoint(self, blocking: bool = False) -> Path:
        self._flush_source_counts()
        result = self.checkpoints.save(self.step, sidecar=self.sidecar())  # on_save, on_commit: logged (fit)
        if blocking:
            self.checkpoints.wait()
        return result.path

    def maybe_resume(self) -> Optional[int]:
        if self.resume_point is None:
            if self.cfg.train.init_from:  # weights only (e.g. from `lmforge import hf`); see checkpoint/weights.py
                load_model_weights(Path(self.cfg.train.init_from), self.engine.inner, self.cfg.model)
            return None
        state = self.checkpoints.resume(self.resume_point)
        self.step = int(state["step"])
        self.data.load_state_dict(state["data"])
        self.wandb_run_id = state.get("wandb_run_id")
        self.resumed_replica_ft = state.get("replica_ft")  # the torchft Manager's state (fault.replica_ft), if saved
        changed = scheduler_changes(state.get("scheduler"), self.cfg.optim, self.cfg.train.max_steps)
        if changed and self.rank == 0:
            print(f"lmforge: warning: the LR schedule differs from the checkpoint's: {'; '.join(changed)}", flush=True)
        at = self.ramp.samples_before(self.step) if self.ramp else self.data.state.consumed_samples
        if at != self.data.state.consumed_samples and self.rank == 0:  # the ramp changed: the samples lead
            print(
                f"lmforge: warning: the checkpoint consumed {self.data.state.consumed_samples:,} samples in "
                f"{self.step} steps, this batch ramp {at:,}; its batches and LR follow the samples consumed",
                flush=True,
            )
        return self.step

    def start_replica_ft(self) -> Optional[ReplicaFT]:
        """fault.replica_ft=torchft: join the torchft job (its Manager; the engine averages and commits through it),
        announcing the semantics in two lines; None otherwise."""
        cfg = self.cfg.fault
        if cfg.replica_ft != "torchft":
            return None
        ft = ReplicaFT(
            cfg,
            engine=self.engine,
            data=self.data,
            plan=self.plan,
            run_dir=self.paths.root,
            rank=self.rank,
            world_size=self.world.world_size,
            get_step=lambda: self.step,
            set_step=lambda step: setattr(self, "step", step),
            manager_state=self.resumed_replica_ft,
        )
        self.engine.cross_replica = ft
        self.faults.compare_groups(ft, self.world.world_size)  # fault.consistency_every: the groups' fingerprints
        if self.rank != 0:
            return ft
        ranks = self.world.world_size
        print(
            f"lmforge: replica_ft=torchft: replica group {cfg.replica_id} of {cfg.replica_groups} (commits with >= "
            f"{cfg.replica_min}), {ranks} rank(s) each; DYNAMIC membership: a step's global batch is the "
            f"participating groups x train.global_batch_size={self.plan.global_batch_size}, smaller while a group is "
            "down",
            flush=True,
        )
        print(
            "lmforge: replica_ft=torchft: gradients and the loss are averaged across groups through torchft (rank i "
            "of each group with rank i of the others, after this group's own data-parallel reduction), and so are the "
            "replica check's fingerprints (fault.consistency_every); the straggler gather, preemption and checkpoint "
            f"votes, token counts and evaluation stay inside this group ({ranks} rank(s)); each group checkpoints "
            "its state and its torchft Manager's into its own run directory",
            flush=True,
        )
        return ft

    def _step_flops(self, batches) -> Optional[float]:
        """FLOPs per token of this rank's step where they differ from the run's: document-masked (attention within
        documents only) or shorter sequences (train.seq_len_schedule); None: the run's."""
        if not self.cfg.data.document_masking:
            length = batches[0].tokens.shape[1]
            return None if self.seq_warmup is None else flops_per_token(self.cfg.model, length)
        return document_flops_per_token(
            self.cfg.model, sum(b.document_square_sum for b in batches), sum(b.tokens.numel() for b in batches)
        )

    # ---- evaluation ----------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        self.engine.eval()
        out = {}
        if self.token_bytes is None:
            self.token_bytes = token_byte_lengths(self.tokenizer, self.cfg.model.vocab_size).to(self.device)
        for source in self.mixture.sources:
            losses, counts = [], torch.zeros(2, dtype=torch.int64, device=self.device)  # (bytes, tokens) here
            for b in self.data.valid_batches(source, self.cfg.train.eval_batches):
                losses.append(float(self.engine.eval_loss(b.tokens, b.targets, b.positions)))
                kept = b.targets >= 0  # data.loss_after_eod=mask: -100 targets are not scored, nor counted
                counts += torch.stack(
                    [torch.where(kept, self.token_bytes[b.targets.clamp_min(0)], 0).sum(), kept.sum()]
                )
            if is_distributed() and self.engine.dp_size > 1:
                torch.distributed.all_reduce(counts, group=self.engine.dp_group)  # collective: bytes, tokens over dp
            loss = sum(losses) / len(losses)
            out[f"val/{source}/loss"] = loss
            out[f"val/{source}/ppl"] = math.exp(min(loss, 50.0))
            out[f"val/{source}/bpb"] = bits_per_byte(loss, int(counts[1]), int(counts[0]))
        if self.tasks is not None:  # collectives: the engine's forwards, one all-reduce of the scores per task
            metrics, records = self.tasks.run(self.engine)
            out.update(metrics)
            if self.rank == 0:  # each document's per-choice log-likelihoods
                evals = make_dir(self.paths.evals)
                for task, rows in records.items():
                    write_text(
                        evals / f"{task}-step-{self.step:08d}.jsonl", "".join(json.dumps(r) + "\n" for r in rows)
                    )
        self.engine.train()
        return out

    # ---- the loop ------------------------------------------------------------------------------------
    def fit(self) -> List[dict]:
        """Train from the resumed step to ``train.max_steps`` (or ``train.stop_at_step``).

        Every rank runs the same calls in the same order; each collective of a step is named below ("collective:").
        """
        t_load = time.perf_counter()
        resumed = self.maybe_resume()
        load_s = time.perf_counter() - t_load
        self._write_run_files()
        log = self.logger = self._make_logger()
        ledger = self.ledger = GoodputLedger(self.paths.goodput_ledgers, self.launch, enabled=self.rank == 0)
        self.checkpoints.on_save = lambda step, path, stall_s: log.event(
            "checkpoint_save", step=step, stall_s=stall_s, async_mode=self.cfg.checkpoint.async_mode, path=str(path)
        )
        self.checkpoints.on_commit = lambda step, path, write_s: log.event(
            "checkpoint_commit", step=step, write_s=write_s, path=str(path)
        )
        talk = self.rank == 0 and self.cfg.logging.console != "none"  # the start block and the summary
        if self.rank == 0:
            start = self.start_info(resumed)
            if talk:
                extra = [self.ramp.describe(self.cfg.train.max_steps)] if self.ramp else []
                extra += [self.seq_warmup.describe(self.cfg.parallelism.compile)] if self.seq_warmup else []
                print("\n".join(start_block(start) + extra), flush=True)
            if self.wandb_sink is not None:
                self.wandb_sink.describe(run_info(start, provenance.toolchain(), provenance.node_list()))
        if resumed is not None:  # the console's one line of it: "[event] resume ... resumed from step N path=..."
            log.event("resume", step=resumed, cause=f"resumed from step {resumed}", path=str(self.resume_point.path))
        cfg = self.cfg
        last_step = min(self.run_steps, cfg.train.stop_at_step or self.run_steps)
        self.engine.train()
        faults = self.faults = FaultHooks(
            cfg,
            self.paths,
            rank=self.rank,
            device=self.device,
            logger=log,
            preemption=self.preemption,
            engine=self.engine,
            start_step=self.step,
        ).start()  # collective: the host names' all_gather for the straggler events (metrics.straggler_every > 0)
        self.stop_vote = LaggedVote(self.device, "any")
        ending, final_save_s = "unknown", 0.0  # what ended this launch (the ledger's end record)
        try:
            self.replica_ft = self.start_replica_ft()  # the Lighthouse's quorums from here on (fault.replica_ft)
            run_preflight(
                cfg.comm, self.device, paths=self.paths, logger=log, step=self.step
            )  # collective: comm.preflight's bench
            self.meter.start()  # throughput is measured over logging intervals (metrics/meter.py)
            ledger.start(
                start_step=self.step,
                load_s=load_s,
                tokens_per_step=self.plan.tokens_per_step,
                world_size=self.world.world_size,
                replicas=cfg.fault.replica_groups if self.replica_ft is not None else 0,
            )  # goodput: everything before this was start-up (fault/goodput.py)
            while self.step < last_step:
                faults.start_compute_clock()
                t0 = time.perf_counter()
                if self.replica_ft is not None:  # the quorum; a restarted replica takes a healthy peer's state here
                    behind = self.step
                    self.replica_ft.start_step()
                    if self.replica_ft.healed:  # the steps up to the peer's are not this group's (goodput)
                        ledger.healed(behind, time.perf_counter() - t0)
                    if self.step >= last_step:
                        break
                lr = self.scheduled_lr(self.data.state.consumed_samples)  # the step's LR, before it advances
                batches = self.data.step_batches()  # this rank's micro-batches (no collective)
                t_data = time.perf_counter() - t0
                self.note_seq_len(batches)  # train.seq_len_schedule: a new length is an event (host only)
                guard = faults.before_step(self.step)  # watchdog beat, before-step drills; the loss guard (None: off)
                profiled = self.overlap.due(self.step + 1)  # a profiled step counts in no throughput or MFU
                with self.meter.excluded() if profiled else contextlib.nullcontext():
                    with self.overlap.step(self.step + 1, log):
                        # collectives: the layout's (DDP/FSDP/TP/PP), the loss and grad-norm all-reduces
                        result = self.engine.train_step(batches, lr, guard=guard)
                if not result.committed:  # fault.replica_ft: a peer failed, no replica stepped; the step is redone
                    ledger.step(self.step + 1, time.perf_counter() - t0, t_data, committed=False)
                    continue
                self.step += 1
                step_tokens = len(batches) * self.plan.tokens_per_micro_batch * self.plan.dp_size  # all ranks
                if profiled:
                    self.meter.step_left_out()
                else:
                    self.meter.step_done(t_data, self._step_flops(batches), tokens=step_tokens)
                if result.fp8 is not None:  # train.fp8.check_every: float8 vs bf16 loss on a fixed batch
                    self.log_fp8_check(result.fp8)
                # collectives when due: the straggler all_gather, the replica fingerprints' all_gather + all_reduce;
                # side effects: watchdog beats, skipped-step events and pins, drills (may SIGKILL or raise)
                fault_metrics = faults.after_step(self.step, time.perf_counter() - t0)
                self.stop_on_fault()
                self._accumulate_sources(batches)
                if self.step % cfg.logging.every_steps == 0 or self.step == self.run_steps or self.step == 1:
                    self.log_step(result, lr, fault_metrics)  # collective: per-source token counts all-reduced
                if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or self.step == self.run_steps):
                    t_eval = time.perf_counter()
                    with self.meter.excluded():  # evaluation time is not training throughput
                        values = self.evaluate()  # collectives: the engine's eval forwards and loss all-reduces
                    ledger.add_eval(time.perf_counter() - t_eval)
                    log.log(
                        {
                            "kind": "eval",
                            "step": self.step,
                            "tokens_seen": self.data.state.consumed_samples * cfg.model.seq_len,
                            **values,
                        }
                    )
                self.commit_checkpoint()  # collective while an async save is in flight: its vote, then the commit
                if self.vote_stop():  # collective: async all-reduce of the preemption flag, read a step later
                    t_save = time.perf_counter()
                    self.save_after_verdicts(blocking=True)  # collective: the save's barriers
                    ledger.add_save(time.perf_counter() - t_save)
                    ledger.step(self.step, time.perf_counter() - t0, t_data, tokens=step_tokens)  # this step is kept
                    log.event("preemption_checkpoint", step=self.step, cause=self.preemption.name or "signal")
                    raise Preempted()
                if (
                    cfg.checkpoint.enabled
                    and (
                        (cfg.checkpoint.every_steps and self.step % cfg.checkpoint.every_steps == 0)
                        or self.step in cfg.checkpoint.at_steps
                    )
                    and self.step < last_step
                ):
                    t_save = time.perf_counter()
                    self.save_after_verdicts()  # collective: the save's barriers (async: the write runs on)
                    ledger.add_save(time.perf_counter() - t_save)  # the loop's stall (sync: the whole save)
                ledger.step(
                    self.step,
                    time.perf_counter() - t0,
                    t_data,
                    profiled=profiled,
                    tokens=step_tokens,
                    participants=self.replica_ft.count if self.replica_ft is not None else 0,
                )
            self.stop_vote.collect()  # collective: waits for the last stop vote in flight
            faults.book_verdicts(force=True)
            self.stop_on_fault()
            trained = self.step != resumed  # a checkpoint is never re-saved by a launch that trained nothing
            t_save = time.perf_counter()
            if trained and cfg.checkpoint.enabled and (cfg.checkpoint.save_final or self.step < self.run_steps):
                self.save_after_verdicts(blocking=True)  # collective: the save's barriers
            self.checkpoints.wait()  # collective: an async save still in flight is committed (barriers)
            final_save_s = time.perf_counter() - t_save
            ending = "done" if self.step >= self.run_steps else "stopped"
            if self.rank == 0 and self.step >= self.run_steps:
                write_text(self.paths.done_marker, json.dumps({"step": self.step}))
        except BaseException as exc:  # the launch's end record names what ended it; the exception goes on
            ending = type(exc).__name__
            raise
        finally:
            self.data.close()
            faults.close()
            if self.replica_ft is not None:
                self.replica_ft.close()
            if talk and ending in ("done", "stopped"):
                lines = self.summary.lines(
                    start_step=resumed or 0,
                    end_step=self.step,
                    max_steps=self.run_steps,
                    wall_s=time.time() - run_start_time(),
                )
                print("\n".join(lines), flush=True)
            report = self.close_ledger(ending, final_save_s)
            try:
                if report is not None:  # goodput/* series in W&B and TensorBoard, a record in metrics.jsonl
                    log.log(goodput_record(report, self.step))
            finally:
                log.close()
            if self.rank == 0:
                for folder in (self.paths.wandb, self.paths.tensorboard):  # written by W&B's and TensorBoard's
                    set_tree(folder)  # own writers: they take the run's modes
        if ending == "stopped" and self.rank == 0:
            print(self.stopped_line(), flush=True)  # the last line: how to go on (after the goodput line)
        elif ending == "done" and self.rank == 0:
            newest = latest(self.checkpoints.root) if cfg.checkpoint.enabled else None
            print(
                next_steps_line(
                    str(self.paths.root),
                    newest and str(newest),
                    self.step,
                    resume=cfg.train.resume,
                    max_steps=cfg.train.max_steps if self.ramp else None,
                ),
                flush=True,
            )
        return self.history

    # ---- the loop's named steps --------------------------------------------------------------------------
    def close_ledger(self, ending: str, final_save_s: float) -> Optional[dict]:
        """The launch's end record, then (rank 0) ``goodput.json`` over every launch so far and its one line; returns
        the report (None on other ranks, or when it could not be written)."""
        self.ledger.end(self.step, ending, final_save_s)
        if self.rank != 0:
            return None
        try:
            report = write_goodput(self.paths.root)
        except (GoodputError, OSError, ValueError, KeyError) as exc:  # the accounting never fails a run
            print(f"lmforge: warning: goodput.json not written: {exc}", flush=True)
            return None
        print(summary_line(report), flush=True)
        return report

    def stopped_line(self) -> str:
        """What a launch that stopped before ``train.max_steps`` (``train.stop_at_step``) prints last: how to go on."""
        cfg, step = self.cfg, self.step
        of = f"{self.run_steps} (batch ramp)" if self.ramp else f"train.max_steps={cfg.train.max_steps}"
        stopped = f"lmforge: stopped at step {step} of {of} (train.stop_at_step={cfg.train.stop_at_step})"
        if not cfg.checkpoint.enabled:
            return f"{stopped}; checkpoint.enabled=false: nothing saved to continue from"
        return (
            f"{stopped}; checkpoint {step_dir(self.checkpoints.root, step)}. To continue: the same command without "
            f"train.stop_at_step ({continue_hint(cfg.train.resume, step)})"
        )

    def stop_on_fault(self) -> None:
        """The one place a fault verdict ends training: ``Diverged`` (the loss guard) or ``Corrupted`` (the replica
        check), found by ``FaultHooks.after_step``/``book_verdicts``. Every rank holds the same verdict."""
        if self.faults.stop is not None:
            raise self.faults.stop

    def save_after_verdicts(self, blocking: bool = False) -> Path:
        """Book every pending loss-guard verdict (a skip streak pins the last good checkpoint first; divergence stops
        here, before anything is saved), then save. Collectives: the save's barriers (and DCP's)."""
        self.faults.book_verdicts(force=True)
        self.stop_on_fault()
        return self.save_checkpoint(blocking=blocking)

    def commit_checkpoint(self) -> Optional[Path]:
        """Commit the async save in flight once every rank has written it; never blocks on I/O.
        Collectives while a save is in flight: a lagged all-reduce vote ("written on every rank?"); once agreed,
        the commit's barriers (rank 0 renames, applies retention and logs ``checkpoint_commit``)."""
        return self.checkpoints.poll()

    def vote_stop(self) -> bool:
        """Collective: this rank's preemption flag joins an async all-reduce (MAX); returns the previous step's
        agreed answer, so every rank stops at the same step, one step after the signal, without a stall."""
        return self.stop_vote.exchange(self.preemption.requested)

    def log_step(self, result, lr: float, fault_metrics: dict) -> None:
        """A logging step's record (rank 0's sinks). Collective: the per-source token counts are all-reduced over
        the data-parallel group; the only host reads of the step's device values happen here."""
        cfg = self.cfg
        self._flush_source_counts()
        throughput = self.meter.measure()  # syncs the device: the interval since the last log
        consumed = self.data.state.consumed_samples
        record = {
            "kind": "train",
            "step": self.step,
            "loss": float(result.loss),
            "lr": lr,
            "grad_norm": float(result.grad_norm),
            "tokens_seen": consumed * cfg.model.seq_len,
            "flops_seen": consumed * cfg.model.seq_len * self.flops_per_token,
            "consumed_samples": consumed,
            **({"seq_len": self.seq_len_now} if self.seq_warmup else {}),
            **throughput,
            **{f"tokens/{k}": v for k, v in self.data.state.tokens_per_source.items()},
            **self.data.share_metrics(),
            **self._memory(),
            **fault_metrics,
            **{k: float(v) for k, v in (result.moe or {}).items()},
        }  # MoE expert load (model/moe.py)
        if throughput:  # the planner's figures beside the measured ones (an interval was measured)
            record.update(self.prediction)
            self._warn_prediction_gap(record)
        self.history.append(record)
        self.logger.log(record)

    def _warn_prediction_gap(self, record: dict) -> None:
        """Once per launch, on a GPU, from the second logged interval on (the first holds warm-up and compilation):
        measured step time or memory more than 25% away from the planner's prediction."""
        if self.prediction_warned or self.step <= self.cfg.logging.every_steps:
            return
        gap = prediction_gap(record)
        if gap is not None:
            self.prediction_warned = True
            if self.rank == 0:
                print(f"lmforge: warning: {gap}", flush=True)

    def log_fp8_check(self, values: dict) -> None:
        """The float8 numerics check's record (``kind: fp8_check``) and, beyond train.fp8.check_tolerance, a warning
        (rank 0). Reads the check's device values: one sync, on check steps only."""
        record = {"kind": "fp8_check", "step": self.step, **{k: float(v) for k, v in values.items()}}
        self.logger.log(record)
        warning = gap_warning(record, self.cfg.train.fp8.check_tolerance, self.step)
        if warning and self.rank == 0:
            print(f"lmforge: warning: {warning}", flush=True)

    def _accumulate_sources(self, batches) -> None:
        """Count this rank's consumed tokens per source locally; summed over ranks by _flush_source_counts."""
        for mb in batches:
            for sid in mb.source_ids:
                self._pending_source_tokens[sid] += self.cfg.model.seq_len

    def _flush_source_counts(self) -> None:
        counts = torch.tensor(self._pending_source_tokens, dtype=torch.int64, device=self.device)
        if is_distributed() and self.engine.dp_size > 1:
            torch.distributed.all_reduce(counts, group=self.engine.dp_group)
        self.data.count_tokens({s: int(c) for s, c in zip(self.mixture.sources, counts.tolist())})
        self._pending_source_tokens = [0] * len(self.mixture.sources)

    def _memory(self) -> dict:
        if self.device.type == "cuda":
            return {"peak_memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}
        try:
            import resource

            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # CPU: the process's peak RSS
            return {"peak_memory_gib": rss, "peak_rss_gib": rss}
        except ImportError:  # pragma: no cover
            return {}
