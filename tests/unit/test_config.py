"""Config composition and the exact errors a user sees for bad configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.config.batch import batch_plan
from lmforge.config.compose import compose, conf_dir
from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate
from lmforge.model.gpt import param_count_from_config

EXPS = sorted(p.stem for p in (conf_dir() / "exp").glob("*.yaml"))


def test_every_group_has_presets():
    for group in ("model", "parallelism", "comm", "data", "optim", "train", "checkpoint", "logging", "cluster", "exp"):
        assert list((conf_dir() / group).glob("*.yaml")), f"conf/{group} has no presets"


@pytest.mark.parametrize("exp", EXPS)
def test_every_exp_composes_and_validates(exp):
    cfg = compose([f"+exp={exp}"])
    p = cfg.parallelism
    world = p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp
    typed = validate(cfg, world_size=world)
    import yaml

    defaults = yaml.safe_load((conf_dir() / "exp" / f"{exp}.yaml").read_text())["defaults"]
    expected_model = next(d["override /model"] for d in defaults if isinstance(d, dict) and "override /model" in d)
    assert typed.model.name == expected_model  # the preset's model, whatever the exp is called


def test_required_exps_exist():
    assert {"smoke", "gpt_125m", "gpt_350m", "gpt_1b", "gpt_7b"} <= set(EXPS)


def test_gpt_1b_size_and_override():
    cfg = compose(["+exp=gpt_1b", "optim.lr=3e-4"])
    assert cfg.optim.lr == 3e-4
    n = param_count_from_config(validate(cfg, world_size=8).model)
    assert 1.1e9 <= n <= 1.3e9, n


def test_typo_on_command_line_names_closest_key():
    with pytest.raises(ConfigError) as e:
        compose(["model.n_layr=3"])
    assert str(e.value) == "config key 'model.n_layr': is not a known key. Fix: did you mean 'model.n_layers'?"


def test_typo_inside_nested_section():
    with pytest.raises(ConfigError) as e:
        compose(["logging.wandb.projct=x"])
    assert "did you mean 'logging.wandb.project'?" in str(e.value)


def test_free_form_sections_accept_new_keys():
    cfg = compose(["+comm.env.NCCL_DEBUG=INFO", "data.sources.books.weight=0.5"])
    assert cfg.comm.env.NCCL_DEBUG == "INFO"


def test_plus_added_unknown_key_fails_with_closest_key():
    cfg = compose(["+model.n_layr=3"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == "config key 'model.n_layr': is not a known key. Fix: did you mean 'model.n_layers'?"


def test_plus_added_unknown_top_level_key():
    cfg = compose(["+trian.max_steps=3"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert "'trian'" in str(e.value) and "did you mean 'train'?" in str(e.value)


def test_wrong_type_is_rejected_at_compose():
    with pytest.raises(Exception) as e:
        compose(["model.n_layers=abc"])
    assert "n_layers" in str(e.value) and "abc" in str(e.value)


def test_out_of_range_value():
    cfg = compose(["model.n_layers=0"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == "config key 'model.n_layers': must be >= 1, got 0. Fix: set a positive value"


def test_bad_choice_suggests_closest():
    cfg = compose(["train.precision=bf16_mixed"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert "did you mean 'bf16-mixed'?" in str(e.value)


def test_inconsistent_batch_arithmetic():
    cfg = compose(["train.micro_batch_size=3", "train.global_batch_size=8"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value).startswith("config key 'train.global_batch_size': 8 is not divisible by micro_batch_size (3)")


def test_explicit_grad_accum_must_agree():
    cfg = compose(["parallelism=ddp", "train.micro_batch_size=2", "train.global_batch_size=8", "train.grad_accum=3"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2)
    assert "global_batch_size (8) != micro_batch_size (2) x grad_accum (3) x data-parallel size (2) = 12" in str(
        e.value
    )


def test_batch_plan_derives_accumulation():
    plan = batch_plan(micro_batch_size=4, global_batch_size=64, dp_size=4, seq_len=128)
    assert plan.grad_accum == 4 and plan.tokens_per_step == 64 * 128


def test_world_size_mismatch_names_the_fix():
    cfg = compose(["parallelism=ddp"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=4)
    assert "world size 4" in str(e.value) and "Fix:" in str(e.value)


def test_heads_must_divide_model_width():
    cfg = compose(["model.n_heads=5"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert "d_model (256) is not divisible by n_heads (5)" in str(e.value)


def test_conf_dir_points_at_repo():
    assert conf_dir() == Path(__file__).resolve().parents[2] / "conf"


def test_actionable_errors_survive_pickling():
    """torch.distributed pickles a failing rank's exception (DCP planners, all_gather_object): the one-line
    message and the fields must arrive intact whatever the subclass's __init__ takes."""
    import pickle

    from lmforge.checkpoint.safe_io import UnsafeCheckpointError

    for err in (
        ConfigError("train.resume", "no checkpoint there", "train.resume=auto"),
        UnsafeCheckpointError("ckpt/.metadata", "refused global os.system"),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__
