"""The torchft launcher's command lines and its bad-input refusals (python -m lmforge.launch.replica_ft, in-process)."""

from __future__ import annotations

import pytest

from lmforge.launch.replica_ft import main


def test_dry_run_prints_the_lighthouse_and_one_command_per_group(capsys):
    assert main(["--replicas", "3", "--name", "ft", "--port", "29600", "--dry-run", "model=tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert lines[0].endswith(
        "torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:29600 --join_timeout_ms 30000 --heartbeat_timeout_ms 2000"
    )
    for i, line in enumerate(lines[1:]):
        assert line.endswith(
            f"-m lmforge.train model=tiny run.name=ft/replica-{i} fault.replica_ft=torchft fault.replica_groups=3 "
            f"fault.replica_id={i} fault.replica_min=2 fault.lighthouse=http://127.0.0.1:29600"
        )


def test_groups_of_several_ranks_are_one_torchrun_each_on_its_own_rendezvous_port(capsys):
    argv = ["--replicas", "2", "--nproc-per-group", "2", "--name", "ft", "--port", "29600", "--dry-run"]
    assert main([*argv, "model=tiny", "parallelism=fsdp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines[1:]):
        assert line.endswith(
            "-m lmforge.launch.agent --nnodes=1 --nproc-per-node=2 --master-addr=127.0.0.1 "
            f"--master-port={29601 + i} --max-restarts=0 -m lmforge.train model=tiny parallelism=fsdp "
            f"run.name=ft/replica-{i} fault.replica_ft=torchft fault.replica_groups=2 fault.replica_id={i} "
            "fault.replica_min=2 fault.lighthouse=http://127.0.0.1:29600"
        )
    assert main([*argv, "--group-port", "30000"]) == 0  # an explicit base port
    assert "--master-port=30001 " in capsys.readouterr().out.splitlines()[2]
    assert main([*argv, "--group-port", "0"]) == 0  # a port free at each group's start
    ports = [int(line.split("--master-port=")[1].split()[0]) for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(ports) == 2 and all(port > 0 for port in ports), ports


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--replicas", "4", "--min-replicas", "2"], "--min-replicas 2 is not a majority of --replicas 4"),
        (["--replicas", "2", "--min-replicas", "3"], "--min-replicas 3 is not a majority of --replicas 2"),
        (["--replicas", "two"], "argument --replicas: invalid int value: 'two'"),
        (["--replicas", "2", "--nproc-per-group", "0"], "--nproc-per-group must be at least 1, got 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, said):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"torchft_local.sh: {said}") and "Fix:" in err
    # control: a majority is accepted
    assert main(["--replicas", "4", "--min-replicas", "3", "--dry-run"]) == 0
