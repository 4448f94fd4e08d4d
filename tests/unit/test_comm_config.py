"""The comm presets: the environment each one exports, what is recorded, and clear errors for bad values."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from lmforge.comm.process_group import choose_backend
from lmforge.comm.transport_env import comm_env_record, comm_environment, export_comm_env
from lmforge.config.comm_checks import check_comm
from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate

PRESETS = ("auto", "cpu_gloo", "infiniband", "roce", "ethernet", "single_node")


def preset(name: str, *more: str):
    return validate(compose([f"comm={name}", *more]), world_size=1).comm


@pytest.fixture(scope="module")
def presets():
    """Every preset, composed by Hydra and validated (all checks) once for the module."""
    return {name: preset(name) for name in PRESETS}


def test_every_preset_composes_and_validates(presets):
    for name, comm in presets.items():
        assert comm.name == name
        env = comm_environment(comm)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


def test_presets_produce_the_expected_environment(presets, tmp_path):
    assert comm_environment(presets["infiniband"], tmp_path / "dumps") == {
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_HCA": "mlx5",
        "NCCL_NET_GDR_LEVEL": "PXB",
        "NCCL_SOCKET_IFNAME": "^lo,docker",
        "NCCL_DEBUG": "WARN",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "dumps" / "nccl_trace_rank_"),
    }  # torch 2.13: the flight recorder's TORCH_FR_* names only (the older TORCH_NCCL_* ones print a warning)
    older = comm_environment(presets["infiniband"], tmp_path / "dumps", torch_version="2.7.1+cu126")
    assert older["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and not any(k.startswith("TORCH_FR_") for k in older)
    assert older["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "dumps" / "nccl_trace_rank_")
    roce = comm_environment(presets["roce"])
    assert roce["NCCL_IB_GID_INDEX"] == "3" and roce["NCCL_IB_TC"] == "106" and roce["NCCL_IB_DISABLE"] == "0"
    eth = comm_environment(presets["ethernet"])
    assert eth["NCCL_IB_DISABLE"] == "1" and not any(k.startswith("NCCL_IB_") and k != "NCCL_IB_DISABLE" for k in eth)
    assert comm_environment(presets["single_node"])["NCCL_IB_DISABLE"] == "1"
    assert comm_environment(presets["cpu_gloo"]) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert presets["cpu_gloo"].backend == "gloo" and presets["infiniband"].backend == "auto"
    # Overrides on the command line land in the exported environment (integers as their decimal string).
    comm = preset(
        "roce", "+comm.env.NCCL_ALGO='Ring,Tree'", "comm.env.NCCL_IB_GID_INDEX=5", "comm.async_error_handling=false"
    )
    env = comm_environment(comm)
    assert env["NCCL_ALGO"] == "Ring,Tree" and env["NCCL_IB_GID_INDEX"] == "5"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def isolate_comm_environment(monkeypatch, names):
    """Unset every comm variable and each of ``names``; all of them are put back as they were after the test
    (the ones export_comm_env sets in this process included: a subprocess a later test starts inherits none)."""
    for key in {*names, *(k for k in os.environ if k.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_FR_")))}:
        monkeypatch.setenv(key, "")  # recorded by monkeypatch even when unset, so undone at teardown
        monkeypatch.delenv(key)


def test_export_keeps_user_values_and_records_them_redacted(presets, monkeypatch, tmp_path):
    isolate_comm_environment(
        monkeypatch,
        [
            *comm_environment(presets["infiniband"], tmp_path / "dumps"),
            "NCCL_SECRET_TOKEN",
            "TORCH_NCCL_TRACE_BUFFER_SIZE",
        ],
    )
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0:1")  # the site's value wins over the preset
    monkeypatch.setenv("NCCL_SECRET_TOKEN", "hunter2-very-secret")
    comm = presets["infiniband"]
    applied = export_comm_env(comm, tmp_path / "dumps")
    assert os.environ["NCCL_IB_HCA"] == "mlx5_0:1" and os.environ["NCCL_NET_GDR_LEVEL"] == "PXB"
    assert applied["NCCL_IB_HCA"] == {"value": "mlx5_0:1", "source": "inherited", "preset_value": "mlx5"}
    assert applied["NCCL_DEBUG"] == {"value": "WARN", "source": "preset"}
    assert (tmp_path / "dumps").is_dir()
    record = json.dumps(comm_env_record(comm, applied, "nccl", 16))
    assert "hunter2" not in record and '"NCCL_SECRET_TOKEN": "***REDACTED***"' in record
    assert json.loads(record)["variables"]["NCCL_NET_GDR_LEVEL"]["value"] == "PXB"
    # A user's value under the older spelling of a flight recorder name wins too (not overridden by the newer one).
    del os.environ["TORCH_FR_BUFFER_SIZE"]
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "500")
    applied = export_comm_env(comm, tmp_path / "dumps")
    assert applied["TORCH_NCCL_TRACE_BUFFER_SIZE"] == {"value": "500", "source": "inherited", "preset_value": "2000"}
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_FR_BUFFER_SIZE" not in applied


def with_env(comm, **env):
    return replace(comm, env={**comm.env, **env})


# (preset, change to the composed preset, key, reason); check_comm is what validate() runs on the comm group.
BAD = [
    (
        "infiniband",
        lambda c: with_env(c, NCCL_ALGO="Rng"),
        "comm.env.NCCL_ALGO",
        "'Rng' in 'Rng' is not a known NCCL algorithm",
    ),
    (
        "infiniband",
        lambda c: with_env(c, NCCL_ALGO="allreduce:ring;allgathr:tree"),
        "comm.env.NCCL_ALGO",
        "'allgathr' in 'allreduce:ring;allgathr:tree' is not an NCCL collective",
    ),
    (
        "infiniband",
        lambda c: with_env(c, NCCL_PROTO="LL256"),
        "comm.env.NCCL_PROTO",
        "'LL256' in 'LL256' is not a known NCCL protocol",
    ),
    (
        "infiniband",
        lambda c: with_env(c, NCCL_DEBUG="LOUD"),
        "comm.env.NCCL_DEBUG",
        "'LOUD' is not an NCCL debug level",
    ),
    (
        "infiniband",
        lambda c: with_env(c, NCCL_NET_GDR_LEVEL="PCI"),
        "comm.env.NCCL_NET_GDR_LEVEL",
        "is not a GPUDirect RDMA level",
    ),
    (
        "ethernet",
        lambda c: with_env(c, NCCL_IB_HCA="mlx5"),
        "comm.env.NCCL_IB_HCA",
        "InfiniBand/RoCE variable on a socket-only preset",
    ),
    (
        "single_node",
        lambda c: with_env(c, NCCL_IB_GID_INDEX="3"),
        "comm.env.NCCL_IB_GID_INDEX",
        "on a local-only preset",
    ),
    (
        "ethernet",
        lambda c: with_env(c, NCCL_NET_GDR_LEVEL="PXB"),
        "comm.env.NCCL_NET_GDR_LEVEL",
        "GPUDirect RDMA needs an RDMA NIC",
    ),
    (
        "infiniband",
        lambda c: with_env(c, NCCL_IB_DISABLE="1"),
        "comm.env.NCCL_IB_DISABLE",
        "turns off the infiniband transport",
    ),
    (
        "cpu_gloo",
        lambda c: with_env(c, NCCL_DEBUG="INFO"),
        "comm.env.NCCL_DEBUG",
        "NCCL variables have no effect with comm.backend=gloo",
    ),
    (
        "roce",
        lambda c: with_env(c, NCCL_IB_GID_INDEX=None),
        "comm.env.NCCL_IB_GID_INDEX",
        "value null (NoneType) is not a string",
    ),
    ("roce", lambda c: with_env(c, NCCL_IB_TC=10.5), "comm.env.NCCL_IB_TC", "value 10.5 (float) is not a string"),
    (
        "auto",
        lambda c: with_env(c, **{"NCCL-DEBUG": "INFO"}),
        "comm.env.NCCL-DEBUG",
        "is not a valid environment variable name",
    ),
    (
        "infiniband",
        lambda c: with_env(c, TORCH_NCCL_ASYNC_ERROR_HANDLING="1"),
        "comm.env.TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "is set from comm.async_error_handling",
    ),
    (
        "infiniband",
        lambda c: replace(c, flight_recorder_entries=0),
        "comm.dump_on_timeout",
        "needs the flight recorder",
    ),
    ("auto", lambda c: replace(c, backend="nccl"), "comm.backend", "nccl needs CUDA devices but train.device=cpu"),
    ("auto", lambda c: replace(c, transport="infiniband_hdr"), "comm.transport", "'infiniband_hdr' is not one of"),
    (
        "auto",
        lambda c: replace(c, preflight_floor_ops="all_reduce,allgather"),
        "comm.preflight_floor_ops",
        "'allgather' is not a bench op",
    ),
    ("auto", lambda c: replace(c, preflight_floor_gbps=-1.0), "comm.preflight_floor_gbps", "must be >= 0"),
]


@pytest.mark.parametrize("name,change,key,reason", BAD, ids=[b[2] + ":" + b[3][:25] for b in BAD])
def test_bad_preset_values_fail_with_key_reason_and_fix(presets, name, change, key, reason):
    with pytest.raises(ConfigError) as info:
        check_comm(change(presets[name]), device="cpu")
    assert info.value.key == key
    assert reason in info.value.reason
    assert info.value.fix


def test_a_bad_value_from_the_command_line_fails_validation_with_exact_message():
    with pytest.raises(ConfigError) as info:
        validate(compose(["comm=infiniband", "comm.env.NCCL_IB_DISABLE=false"]), world_size=1)
    assert str(info.value) == (
        "config key 'comm.env.NCCL_IB_DISABLE': value False (bool) is not a string; environment variables are "
        "exported verbatim and YAML would turn it into 'False'. Fix: quote the value in YAML, e.g. "
        'NCCL_IB_DISABLE: "1"'
    )


def test_nccl_on_a_cpu_device_is_refused_at_init(presets):
    with pytest.raises(ConfigError, match="nccl needs a CUDA device but this rank runs on 'cpu'"):
        choose_backend(replace(presets["auto"], backend="nccl"), torch.device("cpu"))
    assert choose_backend(presets["auto"], torch.device("cpu")) == "gloo"


def test_comm_bench_cli_rejects_a_bad_preset_value_before_starting(capsys):
    from lmforge.cli import main

    assert main(["comm", "bench", "comm=infiniband", "+comm.env.NCCL_PROTO=Fast"]) == 2
    err = capsys.readouterr().err
    assert "config key 'comm.env.NCCL_PROTO': 'Fast' in 'Fast' is not a known NCCL protocol" in err
    assert main(["comm", "bench", "--ops", "all_reduce,allreduce"]) == 2
    assert "unknown collective(s) allreduce" in capsys.readouterr().err


@pytest.mark.parametrize("launcher_env", [{}, {"RANK": "0", "WORLD_SIZE": "1"}])
def test_comm_bench_in_a_world_of_one_says_to_run_it_under_a_launcher(launcher_env, monkeypatch, capsys):
    from lmforge.cli import main

    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in launcher_env.items():
        monkeypatch.setenv(key, value)
    assert main(["comm", "bench", "comm=cpu_gloo", "--device", "cpu", "--ops", "all_reduce"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no table of zeros
    assert err.splitlines() == [
        "lmforge comm bench: world size 1: one process has no peer to move bytes to, so there is no bandwidth to "
        "measure. Fix: run it under a launcher, e.g. torchrun --nproc_per_node=2 -m lmforge.cli comm bench ..."
    ]
    # bad input is still named first, whatever the world size
    assert main(["comm", "bench", "--ops", "allreduce"]) == 2
    assert "unknown collective(s) allreduce" in capsys.readouterr().err
