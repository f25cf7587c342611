"""The example as a multi-node job, simulated on localhost: two ``torchrun`` "nodes" of one process each, and two
tasks with the variables ``srun`` sets (Lightning's ``SLURMEnvironment``). Each node is a separate command line, as on
a cluster; nothing is launched by Lightning itself."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from tests.test_example import EXAMPLE, FAST, finish, losses, read_report, start

TIMEOUT = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(tmp_path: Path, commands: list[list[str]], envs: list[dict[str, str]]) -> list[str]:
    procs = [start(command, tmp_path, env) for command, env in zip(commands, envs, strict=True)]
    deadline = time.monotonic() + TIMEOUT
    outputs = []
    for node, proc in enumerate(procs):
        code, output = finish(proc, max(1.0, deadline - time.monotonic()))
        assert code == 0, f"node {node} exited with {code}:\n{output}"
        outputs.append(output)
    return outputs


def _check_two_node_run(tmp_path: Path, outputs: list[str]) -> None:
    report = read_report(tmp_path / "node0")  # written by global rank 0
    assert report["world_size"] == 2
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert report["ranks"][0]["sent"]["reduce_scatter"] > 0
    assert len(losses(outputs[0])) == 4
    assert not (tmp_path / "node1" / "memory_report.json").exists()


@pytest.mark.timeout(TIMEOUT + 30)
def test_two_node_torchrun_on_localhost(tmp_path):
    port = _free_port()
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(EXAMPLE),
            "strategy=zero2",
            "trainer.num_nodes=2",
            "trainer.devices=1",
            *FAST,
            f"hydra.run.dir={tmp_path / f'node{node}'}",
        ]
        for node in (0, 1)
    ]
    _check_two_node_run(tmp_path, _two_nodes(tmp_path, commands, [{}, {}]))


# 11 s: the two-node torchrun job (the same externally started processes, the same node ranks) runs by default, and
# test_zeropp.py reads SLURM's ranks per node.
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 30)
def test_two_node_slurm_tasks_on_localhost(tmp_path):
    port = str(_free_port())
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_LOCALID": "0",
        "MASTER_PORT": port,  # instead of the port SLURMEnvironment derives from the job id: may be taken here
    }
    envs = [{**slurm, "SLURM_PROCID": str(node), "SLURM_NODEID": str(node)} for node in (0, 1)]
    commands = [
        [
            sys.executable,
            str(EXAMPLE),
            "strategy=zero2",
            "trainer.num_nodes=2",
            "trainer.devices=1",
            *FAST,
            f"hydra.run.dir={tmp_path / f'node{node}'}",
        ]
        for node in (0, 1)
    ]
    outputs = _two_nodes(tmp_path, commands, envs)
    _check_two_node_run(tmp_path, outputs)
