"""Bad input, refused clearly: every case names the problem and the fix, and leaves the files on disk untouched.

This is the one table of user errors (docs/faults.md, "Bad input"); several cases are also tested in depth
where they are implemented. Each row: what the user did, the error type, text naming the problem, text naming the
fix. Cases on a checkpoint damage a saved one first, then check that loading it changes no file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision
from torch import nn

from lightning_zero import RankDivergenceError, ZeroConfig, ZeroOptimizer, ZeroStrategy
from lightning_zero.checkpoint.files import DCP_METADATA_FILE, LIGHTNING_STATE_FILE, CheckpointError
from lightning_zero.sharding.param_groups import trainable_named_groups
from lightning_zero.stage3.sharded_init import _default_init
from lightning_zero.stage3.wrap_policy import find_unit_roots
from lightning_zero.trainer.precision import to_zero_precision
from tests.harness import run_distributed
from tests.test_checkpoint_files import Payload, _load, _mlp, _save
from tests.test_stage3 import _diverge_after_prefetching_started

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

Action = Callable[[], object]


@dataclass(frozen=True)
class Case:
    make: Callable[[Path], Action]  # given a freshly saved checkpoint directory: the call that must fail
    error: type[BaseException]
    problem: str
    fix: str


def _frozen_model_optimizer() -> Action:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.requires_grad_(False)
    return lambda: trainable_named_groups(model, optimizer)


def _shared_across_groups() -> Action:
    model = _mlp()
    weight, *rest = model.parameters()
    optimizer = torch.optim.SGD([{"params": [weight]}, {"params": rest}], lr=0.1)
    # torch refuses this in the optimizer's constructor; groups edited afterwards reach ZeRO, which refuses too.
    optimizer.param_groups[1]["params"].append(weight)
    return lambda: trainable_named_groups(model, optimizer)


def _foreign_tensor() -> Action:
    model = _mlp()
    optimizer = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(7))], lr=0.1)
    return lambda: trainable_named_groups(model, optimizer)


def _not_elementwise() -> Action:
    model = _mlp()
    return lambda: trainable_named_groups(model, torch.optim.LBFGS(model.parameters()))


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def _meta_without_reset() -> Action:
    with torch.device("meta"):
        module = _NoReset()
    return lambda: _default_init(module)


def _add_param_group_after_wrapping() -> Action:
    wrapped = object.__new__(ZeroOptimizer)  # the refusal does not depend on the wrapped state
    return lambda: wrapped.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def _unknown_wrap_class() -> Action:
    return lambda: find_unit_roots(_mlp(), ZeroConfig(stage=3, wrap_module_classes=("Blokc",)))


def _diverging_stage3_ranks() -> Action:
    def run() -> None:
        messages = run_distributed(_diverge_after_prefetching_started, 2, collective_timeout=20)
        raise RankDivergenceError(messages[0])  # the error each rank raised, here as one exception

    return run


def _payload(directory: Path) -> Action:
    marker = directory.parent / "payload-ran"
    torch.save({"epoch": 1, "callbacks": {"x": Payload(marker)}}, directory / LIGHTNING_STATE_FILE)

    def load() -> None:
        try:
            _load(_mlp(), directory)
        finally:
            assert not marker.exists(), "loading ran code from the checkpoint"

    return load


def _shard(directory: Path) -> Path:
    return next(directory.glob("__*.distcp"))


def _truncate(directory: Path) -> Action:
    shard = _shard(directory)
    shard.write_bytes(shard.read_bytes()[:100])
    return lambda: _load(_mlp(), directory)


def _flip_a_bit(directory: Path) -> Action:
    shard = _shard(directory)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return lambda: _load(_mlp(), directory)


def _remove_rank_file(directory: Path) -> Action:
    _shard(directory).unlink()
    return lambda: _load(_mlp(), directory)


def _garble_metadata(directory: Path) -> Action:
    (directory / DCP_METADATA_FILE).write_bytes(b"\x80\x04garbage")
    return lambda: _load(_mlp(), directory)


CASES: dict[str, Case] = {
    "ZeroConfig stage out of range": Case(
        lambda _: lambda: ZeroConfig(stage=4),  # type: ignore[arg-type]
        ValueError,
        "Invalid ZeroConfig.stage: 4",
        "Expected 1, 2 or 3",
    ),
    "ZeroConfig non-positive collective timeout": Case(
        lambda _: lambda: ZeroConfig(collective_timeout_s=0),
        ValueError,
        "Invalid ZeroConfig.collective_timeout_s: 0",
        "Expected a positive number of seconds",
    ),
    "ZeroConfig fractional bucket size": Case(
        lambda _: lambda: ZeroConfig(bucket_numel=1.5),  # type: ignore[arg-type]
        ValueError,
        "Invalid ZeroConfig.bucket_numel: 1.5",
        "Expected a positive integer",
    ),
    "ZeroConfig unknown grad_accumulation": Case(
        lambda _: lambda: ZeroConfig(grad_accumulation="global"),  # type: ignore[arg-type]
        ValueError,
        "Invalid ZeroConfig.grad_accumulation: 'global'",
        "Expected 'sharded' or 'local'",
    ),
    "unknown strategy option": Case(
        lambda _: lambda: ZeroStrategy(stage=2, bucket_numell=10),
        TypeError,
        "Unknown ZeroConfig option(s) ['bucket_numell']",
        "HINT: check the spelling",
    ),
    "unknown start method": Case(
        lambda _: lambda: ZeroStrategy(start_method="thread"),  # type: ignore[arg-type]
        ValueError,
        "Invalid ZeroStrategy start_method: 'thread'",
        "Expected 'popen', 'spawn'",
    ),
    "unsupported precision (64-true)": Case(
        lambda _: lambda: to_zero_precision(DoublePrecision()),
        ValueError,
        "does not support the precision plugin DoublePrecision",
        "HINT: use Trainer(precision=...) with one of 32-true, bf16-mixed",
    ),
    "model with no trainable parameters": Case(
        lambda _: _frozen_model_optimizer(), ValueError, "has no trainable parameters to shard", "HINT: pass the"
    ),
    "parameter shared across param groups": Case(
        lambda _: _shared_across_groups(),
        ValueError,
        "appears in param group 0 and again in param group 1",
        "HINT: put each parameter in exactly one param group",
    ),
    "optimizer over tensors that are not model parameters": Case(
        lambda _: _foreign_tensor(), ValueError, "holds a tensor of shape (7,) that is not a parameter", "HINT: build"
    ),
    "optimizer that is not element-wise (LBFGS)": Case(
        lambda _: _not_elementwise(), TypeError, "LBFGS cannot be sharded by ZeRO", "HINT: use an element-wise"
    ),
    "meta-device module without reset_parameters": Case(
        lambda _: _meta_without_reset(), TypeError, "_NoReset built on the meta device", "HINT: give the module"
    ),
    "add_param_group after wrapping": Case(
        lambda _: _add_param_group_after_wrapping(),
        NotImplementedError,
        "does not support add_param_group after sharding",
        "HINT: create every param group in `configure_optimizers`",
    ),
    "wrap_module_classes naming a class not in the model": Case(
        lambda _: _unknown_wrap_class(),
        ValueError,
        "['Blokc'] name no module class of MLP",
        "HINT: use a class name from that list",
    ),
    "stage 3 ranks running modules in different orders": Case(
        lambda _: _diverging_stage3_ranks(),
        RankDivergenceError,
        "rank 1: 'rare'",
        "HINT: make data-dependent branches agree across ranks",
    ),
    "checkpoint from another model": Case(
        lambda d: lambda: _load(nn.Sequential(nn.Linear(6, 16), nn.Linear(16, 3)), d),
        CheckpointError,
        "missing from the checkpoint ['0.bias'",
        "HINT",
    ),
    "checkpoint with other parameter shapes (world size / stage changes all reshard)": Case(
        lambda d: lambda: _load(_mlp(hidden=8), d),
        CheckpointError,
        "Shape mismatch for 'net.0.weight'",
        "HINT",
    ),
    "truncated shard": Case(_truncate, CheckpointError, "is truncated", "HINT: the copy or the disk was interrupted"),
    "corrupted shard bytes": Case(_flip_a_bit, CheckpointError, "is corrupted: its CRC-32", "HINT: re-copy"),
    "missing rank file": Case(_remove_rank_file, CheckpointError, "is missing", "HINT: a checkpoint is usable only"),
    "corrupted metadata file": Case(
        _garble_metadata, CheckpointError, "Refused to load corrupted or unsafe checkpoint metadata", "HINT: the file"
    ),
    "pickled payload in a checkpoint": Case(
        _payload, CheckpointError, "Refused to load", "HINT: checkpoints are loaded with weights_only=True"
    ),
    "checkpoint path that is not a checkpoint": Case(
        lambda d: lambda: _load(_mlp(), d.parent / "no-such.ckpt"),
        CheckpointError,
        "no-such.ckpt does not exist",
        "HINT: pass a directory written by ZeroStrategy",
    ),
}


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in directory.rglob("*")
        if p.is_file()
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_naming_the_problem_and_the_fix(name, tmp_path):
    case = CASES[name]
    saved = _save(_mlp(), tmp_path / "ck" / "epoch=1-step=7.ckpt")
    action = case.make(saved)
    before = _digest(tmp_path)
    with pytest.raises(case.error) as raised:
        action()
    message = str(raised.value)
    assert case.problem in message, message
    assert case.fix in message, message
    assert _digest(tmp_path) == before  # nothing written, removed or changed on disk


def test_the_table_has_every_case_the_issue_lists():
    assert len(CASES) >= 15
