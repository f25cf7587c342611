"""``state_dict_type="full"`` on every backend (Note [full checkpoint on NCCL]): a full save stages and sends each
shard on the device NCCL carries (it has no host backend) and on the host over gloo. On the CPU the NCCL branch of
the collectives runs on gloo (``LIGHTNING_ZERO_NATIVE_COLLECTIVES=1``); on GPUs (``gpu`` marker, and the section
``full_save_nccl`` of ``scripts/gpu_check.sh``) the save runs on NCCL itself. Not yet run on a GPU."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.checkpoint import full_save
from lightning_zero.checkpoint.full_save import save_full_checkpoint, staging_device
from lightning_zero.checkpoint.sharded_checkpoint import sharded_model_state, sharded_optimizer_state
from lightning_zero.comm.collectives import NATIVE_COLLECTIVES_ENV
from lightning_zero.models.gpt import GPT, GPTConfig
from tests.harness import run_distributed


def full_save_round_trip(device: torch.device, path: str) -> dict[str, Any]:
    """In a rank of a default process group: a stage-3 GPT trained one step on ``device``, saved as one full file,
    read back with ``torch.load(weights_only=True)`` and compared with the gathered model and the Adam state."""
    config = GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    zero = ZeroConfig(stage=3, bucket_numel=3_000)  # parameters straddle ranks
    gatherer = shard_module(model, zero, dist.group.WORLD, device)
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), dist.group.WORLD, zero, gatherer)
    tokens = torch.randint(0, config.vocab_size, (4, config.block_size + 1), device=device)
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()
    checkpoint = {
        "state_dict": sharded_model_state(model, [optimizer], gatherer),
        "optimizer_states": [sharded_optimizer_state([optimizer], 0)],
    }
    save_full_checkpoint(checkpoint, path, model, [optimizer], dist.group.WORLD, gatherer)
    with gatherer.gathered():
        expected = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in model.state_dict().items()}
    saved = torch.load(path, weights_only=True)
    errors = {k: (saved["state_dict"][k] - v).abs().max().item() for k, v in expected.items()}
    (adam,) = saved["optimizer_states"]
    return {
        "backend": str(dist.get_backend()),
        "staged_on": str(staging_device(gatherer.all_buckets()[0].device, dist.group.WORLD)),
        "keys": sorted(saved["state_dict"]) == sorted(expected),
        "max_error": max(errors.values()),
        "adam_entries": len(adam["state"]),
        "parameters": sum(1 for _ in model.parameters()),
        "finite": all(bool(t.isfinite().all()) for e in adam["state"].values() for t in e.values()),
    }


def _on_gloo(path: str) -> dict[str, Any]:
    return full_save_round_trip(torch.device("cpu"), path)


@pytest.mark.timeout(90)
def test_a_full_save_through_the_native_collectives_reads_back_whole():
    """The NCCL branch of every collective, on gloo: the full file holds the exact model and Adam state."""
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "full.ckpt")
        env = {NATIVE_COLLECTIVES_ENV: "1"}
        for result in run_distributed(_on_gloo, 2, path, env=env, timeout=80):
            assert result["backend"] == "gloo"
            assert result["staged_on"] == "cpu"
            assert result["keys"]
            assert result["max_error"] == 0
            assert result["adam_entries"] == result["parameters"]
            assert result["finite"]


def test_a_full_save_stages_on_the_device_of_a_group_without_a_host_backend(monkeypatch):
    """NCCL carries device tensors only, gloo's point-to-point ops host tensors only (Note [full checkpoint on
    NCCL]); a full save stages each shard where its group can send it."""
    cuda = torch.device("cuda", 1)
    for backend, device, expected in [
        ("nccl", cuda, cuda),  # staged on the CPU, the first send failed: no host backend
        ("cpu:gloo,cuda:nccl", cuda, cuda),
        ("gloo", cuda, torch.device("cpu")),  # ranks sharing a GPU over gloo
        ("gloo", torch.device("cpu"), torch.device("cpu")),
    ]:
        monkeypatch.setattr(full_save.dist, "get_backend", lambda group, backend=backend: backend)
        assert staging_device(device, object()) == expected, (backend, device)  # type: ignore[arg-type]
    assert staging_device(cuda, None) == torch.device("cpu")  # one process: nothing is sent


def _on_nccl(path: str) -> dict[str, Any]:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return full_save_round_trip(device, path)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [pytest.param(n, marks=pytest.mark.gpus(n), id=f"{n}gpu") for n in (1, 2)])
def test_a_full_save_on_nccl_reads_back_whole(world):
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "full.ckpt")
        for result in run_distributed(_on_nccl, world, path, init_process_group=False, timeout=100):
            assert result["backend"] == "nccl"
            assert result["staged_on"].startswith("cuda")
            assert result["keys"]
            assert result["max_error"] == 0
            assert result["adam_entries"] == result["parameters"]
            assert result["finite"]
