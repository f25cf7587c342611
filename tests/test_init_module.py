"""``trainer.init_module(empty_init=True)``: at stage 3 the model is built on the meta device and materialized unit by
unit in ``setup`` (as FSDP's strategy does), with ``configure_model``'s initialization; stages 1 and 2 behave as DDP.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroConfig, ZeroStrategy, shard_module
from lightning_zero.models.gpt import GPT, GPTConfig
from tests import memory_probe
from tests.harness import run_distributed
from tests.parity import build_model
from tests.test_strategy import STEPS, ParityModule, _dataset, _full_weights, _trainer, assert_fits_match, fit


@pytest.mark.parametrize(("stage", "empty_init", "on_meta"), [(3, True, True), (3, None, False), (2, True, False)])
def test_init_module_builds_on_meta_only_at_stage_3_with_empty_init(stage, empty_init, on_meta):
    trainer = pl.Trainer(strategy=ZeroStrategy(stage=stage), accelerator="cpu", devices=2, logger=False)
    with trainer.init_module(empty_init=empty_init):
        layer = nn.Linear(4, 4)
    assert layer.weight.is_meta == on_meta
    assert layer.weight.device.type == ("meta" if on_meta else "cpu")


class _InitialWeights(pl.Callback):
    """Every parameter in full at the start of the fit, after ``setup`` materialized and sharded the model."""

    def __init__(self) -> None:
        self.weights: dict[str, Tensor] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = _full_weights(trainer, pl_module.model)


def _fit_in_init_module() -> dict[str, Any]:
    initial = _InitialWeights()
    trainer = _trainer(ZeroStrategy(stage=3), callbacks=[initial])
    with trainer.init_module(empty_init=True):
        module = ParityModule("gpt", "adamw")  # build_model seeds: the same seed as the direct build
    on_meta = all(p.is_meta for p in module.parameters())
    trainer.fit(module, DataLoader(_dataset("gpt", 2 * 4 * STEPS), batch_size=4))
    result = {"losses": module.losses, "lrs": module.lrs, "weights": _full_weights(trainer, module.model)}
    return {"meta": on_meta, "initial": initial.weights, "fit": result}


def _ddp_then_zero3_init_module() -> list[dict[str, Any]]:
    return [fit("ddp", "gpt", "adamw"), _fit_in_init_module()]


@pytest.mark.timeout(180)
def test_zero3_init_module_with_empty_init_equals_a_direct_build_and_trains_as_ddp():
    direct = dict(build_model("gpt").named_parameters())
    for reference, sharded in run_distributed(_ddp_then_zero3_init_module, 2, init_process_group=False):
        assert sharded["meta"]
        assert sharded["initial"].keys() == direct.keys()
        for name, expected in direct.items():  # reset_parameters() in construction order: bit-identical
            torch.testing.assert_close(sharded["initial"][name], expected, rtol=0, atol=0, msg=name)
        assert_fits_match(reference, sharded["fit"])


def _fit_lora_in_init_module() -> list[float]:
    from tests.third_party_models import fit_probe

    return list(fit_probe("hf_lora", ZeroStrategy(stage=3), build_in="init_module")["losses"])


@pytest.mark.timeout(120)
def test_zero3_init_module_initializes_a_hugging_face_model_and_its_lora_adapters_as_their_libraries_do():
    """peft LoRA on a ``LlamaForCausalLM`` built under ``init_module(empty_init=True)``: the RMSNorms (no
    ``reset_parameters()``) get the model's ``_init_weights`` and ``lora_B`` starts at zero, so the first loss is an
    initialized model's, ln(96) within 0.1, as with ``configure_model`` (``tests/test_sharded_init.py``)."""
    for losses in run_distributed(_fit_lora_in_init_module, 2, init_process_group=False):
        assert len(losses) == 6
        assert all(math.isfinite(loss) for loss in losses)
        assert abs(losses[0] - math.log(96)) < 0.1, losses


def _wide_gpt(n_layer: int = 8) -> GPT:
    # Blocks of 0.8 M parameters (3.2 MB in fp32, well above allocator noise), little outside them.
    return GPT(GPTConfig.tiny(n_layer=n_layer, n_embd=256, n_head=4, vocab_size=512, block_size=32))


class _WideModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _wide_gpt()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model.loss(*batch)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _PeakOfSetup(pl.Callback):
    """The peak of resident memory while ``setup`` materializes and shards the model (the process group and
    Lightning's code paths already in place)."""

    def __init__(self) -> None:
        self.before_setup = self.peak = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Page in sharding's code paths and gloo's first-collective buffers (~25 MB, once per process).
        with torch.device("meta"):
            warm_up = _wide_gpt(n_layer=1)
        shard_module(warm_up, ZeroConfig(stage=3), dist.group.WORLD, torch.device("cpu"))
        del warm_up
        memory_probe.reset_peak()
        self.before_setup = memory_probe.rss_bytes()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peak = memory_probe.peak_rss_bytes() - self.before_setup


def _memory_of_building(empty_init: bool) -> tuple[int, int, int, int]:
    """(bytes built before setup, peak bytes of setup, the model's full fp32 bytes, this rank's shard bytes)."""
    memory_probe.return_freed_memory_to_the_kernel()
    _wide_gpt()  # page in the code paths before measuring
    with torch.device("meta"):
        _wide_gpt()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3),
        accelerator="cpu",
        devices=4,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    probe = _PeakOfSetup()
    trainer.callbacks.append(probe)
    before_build = memory_probe.rss_bytes()
    with trainer.init_module(empty_init=empty_init):
        module = _WideModule()
    built = memory_probe.rss_bytes() - before_build
    full = 4 * sum(p.numel() for p in module.parameters())
    tokens = torch.randint(0, 512, (4, 17))
    trainer.fit(module, DataLoader([(tokens[i, :-1], tokens[i, 1:]) for i in range(4)], batch_size=1))
    shard = trainer.strategy.model_state_bytes().parameters
    return built, probe.peak, full, shard


@pytest.mark.timeout(180)
def test_zero3_init_module_with_empty_init_never_holds_the_full_model_on_a_rank():
    """4 ranks, a model 4 shards large: built under ``init_module(empty_init=True)`` it takes no memory until
    ``setup``, whose peak is the shard and about one unit; without ``empty_init`` every rank holds the full model."""
    on_meta = run_distributed(_memory_of_building, 4, True, init_process_group=False, timeout=150)
    whole = run_distributed(_memory_of_building, 4, False, init_process_group=False, timeout=150)
    for (built, peak, full, shard), (built_whole, _, _, _) in zip(on_meta, whole, strict=True):
        assert math.isclose(shard, full / 4, rel_tol=0.05), (shard, full)
        unit = full / 8
        assert built < unit, (built / 1e6, full / 1e6)
        assert peak < shard + 3 * unit < 0.65 * full, (peak / 1e6, shard / 1e6, full / 1e6)
        assert built_whole > full, (built_whole / 1e6, full / 1e6)  # the measurement sees a whole build
