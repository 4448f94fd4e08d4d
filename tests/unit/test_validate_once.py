"""One validate() for every entry point: `lmforge plan` refuses what `lmforge train` would (ZeRO stage, the
tokenizer's vocabulary), DeepSpeed with compile is refused before any process group, the batch plan is
validate()'s, and the choice values are the schema's annotations."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lmforge.cli import main as lmforge
from lmforge.config.choices import allowed_values, choice_fields
from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.schema import RootConfig
from lmforge.config.tokenizer_files import vocab_size_of
from lmforge.config.validate import check_batch, validate
from lmforge.data.embedded import iter_documents
from lmforge.data.tokenizer import export_tiktoken, load_tokenizer, train_bpe

DS = [
    "model=tiny",
    "parallelism=zero1",
    "train.micro_batch_size=4",
    "cluster.gpus_per_node=2",
    "cluster.device=cpu",
    "train.device=cpu",
]


def plan(capsys, *overrides):
    rc = lmforge(["plan", *overrides])
    out = capsys.readouterr()
    return rc, [ln for ln in out.err.splitlines() if ln.startswith("lmforge")]


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory) -> Path:
    docs = [d for _, d in zip(range(6), iter_documents("books"))]
    return train_bpe(docs, 300, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_plan_refuses_an_impossible_zero_stage_like_train(capsys):
    rc, lines = plan(capsys, *DS, "parallelism.zero_stage=4")
    assert rc == 2 and lines == [
        "lmforge plan: refused: config key 'parallelism.zero_stage': must be 0, 1, 2 or 3, "
        "got 4. Fix: e.g. parallelism=zero3"
    ]
    rc, lines = plan(capsys, *DS, "parallelism.offload_params=cpu")
    assert rc == 2 and lines == [
        "lmforge plan: refused: config key 'parallelism.offload_params': parameter offload "
        "needs zero_stage=3, got 1. Fix: use parallelism=zero3_offload or set "
        "offload_params=none"
    ]
    assert plan(capsys, *DS, "parallelism.zero_stage=3") == (0, [])  # control: a possible stage plans


def test_plan_refuses_deepspeed_keys_the_native_engine_would_ignore(capsys):
    rc, lines = plan(capsys, "model=tiny", "parallelism.offload_optimizer=cpu")
    assert rc == 2 and lines == [
        "lmforge plan: refused: config key 'parallelism.offload_optimizer': 'cpu' is a "
        "DeepSpeed setting, and parallelism.engine=native would ignore it. Fix: set "
        "parallelism.engine=deepspeed (e.g. parallelism=zero3), or drop the key (native "
        "sharding: parallelism.dp_shard)"
    ]
    rc, lines = plan(capsys, "model=tiny", "parallelism.zero_stage=3")
    assert rc == 2 and lines[0].startswith(
        "lmforge plan: refused: config key 'parallelism.zero_stage': 3 is a DeepSpeed"
    )
    assert plan(capsys, "model=tiny") == (0, [])  # control: the native defaults plan


def test_plan_refuses_a_vocabulary_smaller_than_the_tokenizer(capsys, small_tokenizer):
    rc, lines = plan(capsys, "model=tiny", "model.vocab_size=100")
    assert rc == 2 and lines == [
        "lmforge plan: refused: config key 'model.vocab_size': 100 is smaller than the "
        "tokenizer's vocabulary (8192, embedded). Fix: set model.vocab_size >= 8192"
    ]
    rc, lines = plan(capsys, "model=tiny", "model.vocab_size=299", f"data.tokenizer={small_tokenizer}")
    assert rc == 2 and lines == [
        "lmforge plan: refused: config key 'model.vocab_size': 299 is smaller than the "
        f"tokenizer's vocabulary (300, {small_tokenizer}). Fix: set model.vocab_size >= 300"
    ]
    # control: exactly the tokenizer's vocabulary is enough
    assert plan(capsys, "model=tiny", "model.vocab_size=300", f"data.tokenizer={small_tokenizer}") == (0, [])
    rc, lines = plan(capsys, "model=tiny", f"data.tokenizer={small_tokenizer.parent / 'missing.json'}")
    assert rc == 2 and lines == [
        f"lmforge plan: refused: config key 'data.tokenizer': no tokenizer.json at "
        f"{small_tokenizer.parent / 'missing.json'}. Fix: give an existing path, 'embedded', "
        "or 'tiktoken:NAME' / 'tiktoken:/path/NAME.tiktoken'"
    ]


def test_vocab_size_read_from_the_file_is_the_loaded_tokenizers(small_tokenizer, data_cache, tmp_path):
    rank_file = export_tiktoken(small_tokenizer, tmp_path / "small.tiktoken")
    for spec in ("embedded", str(small_tokenizer), f"tiktoken:{rank_file}"):
        assert vocab_size_of(spec) == load_tokenizer(spec, data_cache).vocab_size, spec
    assert vocab_size_of(str(small_tokenizer)) == 300 and vocab_size_of("embedded") == 8192


def test_deepspeed_with_compile_is_refused_before_any_process_group(tmp_path, monkeypatch):
    import lmforge.trainer.trainer as trainer_module
    from lmforge.train import run

    def no_group(*args, **kwargs):  # an earlier test of this process may hold a group: watch for a new one instead
        raise AssertionError("a process group was created before the config error")

    monkeypatch.setattr(trainer_module, "init_process_group", no_group)

    cfg = compose(
        [
            "model=tiny",
            "parallelism.engine=deepspeed",
            "parallelism.zero_stage=1",
            "parallelism.compile=true",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
            "train.device=cpu",
            f"run.root={tmp_path}",
            "run.name=ds",
        ]
    )
    with pytest.raises(ConfigError) as e:
        run(cfg, tmp_path / "ds")
    assert str(e.value) == (
        "config key 'parallelism.compile': the deepspeed engine runs the model eagerly (it never "
        "calls torch.compile), so compile=true would be silently ignored. Fix: set "
        "parallelism.compile=false, or use parallelism.engine=native to compile"
    )
    assert not (tmp_path / "ds" / "checkpoints").exists()
    validate(OmegaConf.merge(cfg, {"parallelism": {"compile": False}}), world_size=1)  # control: eager DeepSpeed


def test_validate_returns_the_batch_plan_and_reads_as_the_config():
    validated = validate(
        compose(["parallelism=ddp", "train.micro_batch_size=2", "train.global_batch_size=8"]), world_size=2
    )
    cfg, batch = validated
    assert isinstance(cfg, RootConfig) and batch == check_batch(cfg) and batch.grad_accum == 2
    assert validated.train is cfg.train and validated.plan is batch
    assert validate(validated, world_size=2) == validated  # already validated: the same result


def test_choices_are_the_schema_annotations():
    choices = dict(choice_fields(RootConfig))
    assert choices["train.precision"] == ("auto", "fp32", "bf16-mixed", "bf16", "fp8")
    assert choices["comm.transport"] == ("auto", "infiniband", "roce", "socket", "local")
    assert choices["logging.wandb.mode"] == ("auto", "online", "offline", "disabled")
    assert allowed_values(int) is None and "train.max_steps" not in choices
    with pytest.raises(ConfigError) as e:
        validate(compose(["parallelism.pp_schedule=1f1b"]))
    assert str(e.value) == (
        "config key 'parallelism.pp_schedule': '1f1b' is not one of GPipe, 1F1B, Interleaved1F1B, "
        "InterleavedZeroBubble, ZBVZeroBubble. Fix: did you mean '1F1B'? choose one of GPipe, "
        "1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble"
    )


def test_check_start_runs_validate_the_job_checks_then_the_entry_checks_once_each(tmp_path, monkeypatch):
    import lmforge.trainer.startup as startup

    calls = []

    def wrap(name, fn):
        return lambda *args, **kwargs: calls.append(name) or fn(*args, **kwargs)

    monkeypatch.setattr(startup, "validate", wrap("validate", startup.validate))
    monkeypatch.setattr(startup, "entry_checks", wrap("entry_checks", startup.entry_checks))
    cfg = compose(["model=tiny", f"run.root={tmp_path}", "run.name=job"])

    def run_dir_of(validated):  # the Slurm prepare step's: resolved from the validated config
        calls.append(f"run_dir {validated.run.name}")
        return tmp_path / validated.run.name

    checked = startup.check_start(cfg, world_size=1, run_dir=run_dir_of, epochs=False, job_checks=wrap("job", id))
    assert calls == ["validate", "job", "run_dir job", "entry_checks"]
    assert checked.entry.run_dir == tmp_path / "job" and checked.validated.run.name == "job"
    # A job check that refuses stops the start before the entry checks.
    calls.clear()

    def refuse(validated):
        raise ConfigError("cluster.gpus_per_node", "the allocation has none", "ask for GPUs")

    with pytest.raises(ConfigError, match="the allocation has none"):
        startup.check_start(cfg, world_size=1, run_dir=run_dir_of, job_checks=refuse)
    assert calls == ["validate"]


def test_the_trainer_takes_only_what_the_start_up_resolved(tmp_path, monkeypatch):
    import lmforge.trainer.trainer as trainer_module
    from lmforge.trainer.startup import check_start
    from lmforge.trainer.trainer import Trainer

    def no_group(*args, **kwargs):
        raise AssertionError("a process group was created for entry checks the Trainer cannot use")

    monkeypatch.setattr(trainer_module, "init_process_group", no_group)
    cfg = compose(["model=tiny", "train.device=cpu", f"run.root={tmp_path}", "run.name=t"])
    with pytest.raises(TypeError, match="checked"):  # no Trainer re-derives the entry checks itself
        Trainer(validate(cfg, world_size=1), tmp_path / "t")
    # Checks run as `lmforge launch` runs them (no run dir) or without the tokenizer (prepare=False) are refused;
    # the start-up's own (trainer.startup.start: prepare=True, this run dir) are what it takes.
    for run_dir in (None, tmp_path / "t"):
        checked = check_start(cfg, world_size=1, run_dir=run_dir, epochs=False)
        with pytest.raises(ValueError) as e:
            Trainer(checked.validated, tmp_path / "t", checked.entry)
        assert str(e.value) == (
            f"the Trainer takes trainer.startup.start's entry checks (prepare=True, run_dir={tmp_path / 't'}), got "
            f"run_dir={run_dir}, tokenizer not loaded"
        )
    assert not (tmp_path / "t").exists()
