"""Nothing is lost: a crash during a save resumes from the previous checkpoint to the same weights as a run that
never crashed; runs are deterministic; many save / resume / validation cycles neither grow memory nor leave
parameters gathered. (Faults that end a job: test_reliability_faults.py.)

``LIGHTNING_ZERO_SOAK_CYCLES`` sets the cycles of the soak test (3 by default; 20 with ``--runslow``).
"""

from __future__ import annotations

import gc
import os
import signal
import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from lightning_zero import ZeroStrategy
from lightning_zero.stage3.sharded_unit import UnitState
from tests.harness import DistributedTestError, run_distributed
from tests.memory_probe import return_freed_memory_to_the_kernel, rss_bytes
from tests.test_checkpoint_trainer import TinyGPT, assert_same, fit, weights, zero

STEPS = 6


def _last(root: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=2, save_top_k=0, save_last=True)


def _uninterrupted(root: str) -> dict[str, Any]:
    return weights(fit(zero(2), 2, STEPS, root))


def _killed_in_second_save(root: str) -> None:
    write_data = FileSystemWriter.write_data
    calls = []

    def write_then_die(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        future = write_data(self, *args, **kwargs)  # rank 1's shard is on disk; nothing is committed
        calls.append(1)
        if len(calls) == 2 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    fit(zero(2), 2, STEPS, root, callbacks=[_last(root)])


def _resumed(root: str) -> tuple[int, dict[str, Any]]:
    class StartStep(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.step = trainer.global_step

    start = StartStep()
    module = fit(zero(2), 2, STEPS, root, ckpt="last", callbacks=[_last(root), start])
    return start.step, weights(module)


@pytest.mark.timeout(120)
def test_crash_during_save_resumes_from_the_last_complete_checkpoint_to_identical_weights():
    with tempfile.TemporaryDirectory() as root:
        expected = run_distributed(_uninterrupted, 2, root, init_process_group=False)[0]
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(DistributedTestError) as crash:
            run_distributed(_killed_in_second_save, 2, root, init_process_group=False, timeout=60)
        assert "SIGKILL" in crash.value.failures[1]
        for step, resumed in run_distributed(_resumed, 2, root, init_process_group=False):
            assert step == 2  # the save at step 4 never committed: "last" is still step 2's
            assert_same(resumed, expected)  # bit-identical, fp32 on CPU


def _train(root: str, stage: int) -> dict[str, Any]:
    return weights(fit(zero(stage), 2, 4, root))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_same_seed_world_size_and_stage_give_bit_identical_weights(stage):
    runs = []
    for _ in range(2):
        with tempfile.TemporaryDirectory() as root:
            runs.append(run_distributed(_train, 2, root, stage, init_process_group=False)[0])
    assert_same(runs[1], runs[0])


# -- soak --------------------------------------------------------------------------------------------------------------
class ShardedBetweenSteps(pl.Callback):
    """Stage 3: every unit is SHARDED between steps and after validation; counts the checks."""

    def __init__(self) -> None:
        self.checked = 0

    def _check(self, trainer: pl.Trainer, where: str) -> None:
        gatherer = trainer.strategy._gatherer  # type: ignore[attr-defined]
        gathered = [u.name for u in gatherer.units if u.state is not UnitState.SHARDED]
        assert not gathered, f"{where}: units left gathered: {gathered}"
        self.checked += 1

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._check(trainer, f"before step {trainer.global_step}")

    def on_validation_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._check(trainer, f"after validation at step {trainer.global_step}")


class ValidatedGPT(TinyGPT):
    """Validation as a plain forward (TinyGPT's own gathers the full weights inside the step)."""

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        inputs, targets = batch
        # Reading full weights outside the units' forwards (as EMA or export code does) must leave nothing
        # gathered: the first block is prefetched here but never run by this step.
        with self.trainer.strategy.gathered_parameters(self.model.lm_head):
            self.log("head_norm", self.model.lm_head.weight.norm(), sync_dist=True)
        return nn.functional.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())


def _soak(root: str, cycles: int) -> list[int]:
    return_freed_memory_to_the_kernel()
    rss = []
    for cycle in range(cycles):
        module = ValidatedGPT()
        check = ShardedBetweenSteps()
        trainer = pl.Trainer(
            strategy=ZeroStrategy(stage=3, bucket_numel=3_000),
            accelerator="cpu",
            devices=2,
            max_steps=2 * (cycle + 1),
            val_check_interval=1,
            limit_val_batches=2,
            callbacks=[check, _last(root)],
            default_root_dir=root,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = module.train_dataloader()
        trainer.fit(module, loader, loader, ckpt_path=None if cycle == 0 else "last")
        assert trainer.global_step == 2 * (cycle + 1)
        assert check.checked >= 4
        del trainer, module, loader
        gc.collect()
        rss.append(rss_bytes())
    return rss


def _cycles(default: int) -> int:
    return int(os.environ.get("LIGHTNING_ZERO_SOAK_CYCLES", default))


def _assert_soak(cycles: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        for rss in run_distributed(_soak, 2, root, cycles, init_process_group=False, timeout=60 + 20 * cycles):
            growth = rss[-1] - rss[0]  # the first cycle pays the one-off allocations (imports, thread pools)
            assert growth < 32 * 2**20, f"RSS per cycle (MiB): {[r // 2**20 for r in rss]}"


@pytest.mark.timeout(150)
def test_save_resume_validate_cycles_keep_memory_flat_and_parameters_sharded():
    _assert_soak(_cycles(3))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_long_soak():
    _assert_soak(_cycles(20))
