"""``ZeroConfig.exclude_frozen_parameters``: a peft LoRA fine-tune's checkpoints hold the adapters and their optimizer
state, not the frozen base; resuming restores the base from where the run got it (``from_pretrained`` in
``__init__``, or the pretrained directory ``fit(ckpt_path=...)`` loaded into a model built on meta) and matches DDP;
a resume whose frozen base would be missing is refused before training; ``consolidate`` writes the adapters alone.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_zero import ZeroStrategy, consolidate_checkpoint
from lightning_zero.checkpoint.files import CheckpointError
from lightning_zero.checkpoint.format import info_dtype, open_committed
from lightning_zero.checkpoint.storage import locate
from tests.harness import run_distributed
from tests.test_checkpoint_trainer import ResumableLoader
from tests.test_pretrained_weights import Tokens, full_state, llama_config

STEPS = 4
BASE = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128}  # the base outweighs the adapters ~100x


def lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


class LoraFineTune(pl.LightningModule):
    """LoRA on a Hugging Face Llama: the base from ``from_pretrained`` in ``__init__`` (``pretrained``), or built
    from its config in ``configure_model`` (on meta at stage 3) and loaded by ``fit(ckpt_path=...)``."""

    def __init__(self, pretrained: str | None = None) -> None:
        super().__init__()
        self.model: nn.Module | None = None
        if pretrained is not None:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            self.model = lora(AutoModelForCausalLM.from_pretrained(pretrained))
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import LlamaForCausalLM

            self.model = lora(LlamaForCausalLM(llama_config(**BASE)))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None
        loss: Tensor = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return ResumableLoader(Tokens(), batch_size=4)  # a resume goes on with the batches after the checkpoint


def _fit(strategy: Any, module: LoraFineTune, ckpt: str | None, saves: str | None = None) -> LoraFineTune:
    callbacks = [ModelCheckpoint(dirpath=saves, every_n_train_steps=2, save_top_k=-1)] if saves else []
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        callbacks=callbacks,
        enable_checkpointing=bool(saves),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, ckpt_path=ckpt)
    return module


def _adapters(stage: int, **options: Any) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, bucket_numel=4_000, exclude_frozen_parameters=True, **options)


def _resume_like_ddp(root: str, hf_dir: str, stage: int) -> tuple[Any, ...]:
    ddp = _fit("ddp", LoraFineTune(hf_dir), None, saves=f"{root}/ddp")
    _fit(_adapters(stage), LoraFineTune(hf_dir), None, saves=f"{root}/zero")
    resumed = _fit(_adapters(stage), LoraFineTune(hf_dir), f"{root}/zero/epoch=0-step=2.ckpt")
    return ddp.losses, full_state(ddp), resumed.losses, full_state(resumed)


def _bytes(path: Path, pattern: str = "*") -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob(pattern))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lora_checkpoint_holds_the_adapters_and_resumes_to_ddps_numbers(tmp_path, stage):
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    LlamaForCausalLM(llama_config(**BASE)).save_pretrained(tmp_path / "hf")
    ddp_losses, ddp_final, losses, final = run_distributed(
        _resume_like_ddp, 2, str(tmp_path), str(tmp_path / "hf"), stage, init_process_group=False
    )[0]
    torch.testing.assert_close(losses, ddp_losses[2:], rtol=1e-5, atol=0)  # the two steps after the resume
    assert final.keys() == ddp_final.keys()
    for key, value in ddp_final.items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=key)

    module = LoraFineTune(str(tmp_path / "hf"))
    adapters = {k: v for k, v in module.named_parameters() if v.requires_grad}
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapters.values())
    base_bytes = sum(v.numel() * v.element_size() for v in module.parameters())
    sharded, ddp_file = tmp_path / "zero" / "epoch=0-step=4.ckpt", tmp_path / "ddp" / "epoch=0-step=4.ckpt"
    # The tensors stored: the adapters and Adam's two moments (and 0-d steps), nothing of the base; on disk, with
    # the per-record overhead of DCP's files and the metadata, a small fraction of DDP's full checkpoint.
    _, toc, _, _ = open_committed(locate(sharded))
    stored = sum(math.prod(i["shape"]) * info_dtype(i).itemsize for i in toc["tensors"].values() if i["shape"])
    assert stored == 3 * adapter_bytes, (stored, adapter_bytes, base_bytes)
    assert _bytes(sharded) < 0.2 * _bytes(ddp_file), (_bytes(sharded), _bytes(ddp_file), base_bytes)
    out = consolidate_checkpoint(sharded, tmp_path / "adapters.ckpt")
    exported = torch.load(out, weights_only=True)["state_dict"]
    assert set(exported) == set(adapters)  # the adapters alone
    assert all("lora_" in k for k in exported)


def _base_from_its_source(root: str, hf_dir: str) -> tuple[Any, ...]:
    first = _fit(_adapters(3), LoraFineTune(), hf_dir, saves=f"{root}/meta")  # built on meta, base from hf_dir
    resumed = _fit(_adapters(3), LoraFineTune(), f"{root}/meta/epoch=0-step=2.ckpt")
    refusals = []
    moved = Path(hf_dir).with_name("moved")
    if torch.distributed.get_rank() == 0:
        shutil.move(hf_dir, moved)
    torch.distributed.barrier()
    with pytest.raises(CheckpointError, match=r"exclude_frozen_parameters=True.*no longer exists.*HINT"):
        _fit(_adapters(3), LoraFineTune(), f"{root}/meta/epoch=0-step=2.ckpt")
    refusals.append("gone")
    with pytest.raises(ValueError, match=r"exclude_frozen_parameters=True.*no pretrained weights were loaded.*HINT"):
        _fit(_adapters(3), LoraFineTune(), None)
    refusals.append("never loaded")
    return first.losses, full_state(first), resumed.losses, full_state(resumed), refusals


@pytest.mark.timeout(150)
def test_frozen_base_is_restored_from_the_pretrained_directory_or_refused_before_training(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    LlamaForCausalLM(llama_config(**BASE)).save_pretrained(tmp_path / "hf")
    for losses, final, resumed_losses, resumed, refusals in run_distributed(
        _base_from_its_source, 2, str(tmp_path), str(tmp_path / "hf"), init_process_group=False
    ):
        assert resumed_losses == losses[2:]  # bit-identical: the base came back from the directory
        assert all(torch.equal(resumed[k], v) for k, v in final.items())
        assert refusals == ["gone", "never loaded"]


POLICY = {"activation_checkpointing_policy": ("LlamaDecoderLayer",)}
NO_CACHE = {**BASE, "use_cache": False}
"""Recomputing a decoder layer whose forward appends to a key-value cache would append twice; Hugging Face's own
gradient checkpointing turns the cache off for training the same way."""


def _checkpointed(module: nn.Module) -> int:
    from lightning_zero.compat import CheckpointWrapper

    return sum(isinstance(m, CheckpointWrapper) for m in module.modules())


class _LoraNoCache(LoraFineTune):
    def configure_model(self) -> None:
        if self.model is None:
            from transformers import LlamaForCausalLM

            torch.manual_seed(0)  # the same adapters in every run of a stage
            self.model = lora(LlamaForCausalLM(llama_config(**NO_CACHE)))


def _fabric_lora_steps(options: dict[str, Any], hf_dir: str) -> tuple[list[float], int]:
    from transformers import LlamaForCausalLM

    from tests.test_fabric_checkpoint_options import _lora_steps, _zero

    fabric = _zero(3, **options)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        raw = lora(LlamaForCausalLM(llama_config(**NO_CACHE)))
    model = fabric.setup_module(raw)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in raw.parameters() if p.requires_grad], lr=1e-2))
    fabric.load_raw(hf_dir, model, strict=True)
    return _lora_steps(fabric, model, optimizer, 0, 2), _checkpointed(raw)


def _lora_under_the_policy(root: str, hf_dir: str) -> dict[Any, Any]:
    runs: dict[Any, Any] = {}
    for stage in (2, 3):
        first = _fit(_adapters(stage, **POLICY), _LoraNoCache(), hf_dir, saves=f"{root}/{stage}")  # a strict load
        resumed = _fit(_adapters(stage, **POLICY), _LoraNoCache(), f"{root}/{stage}/epoch=0-step=2.ckpt")
        runs[stage] = (first.losses, full_state(first), resumed.losses, full_state(resumed), _checkpointed(first))
    runs["no policy"] = _fit(_adapters(3), _LoraNoCache(), hf_dir).losses
    runs["fabric"] = _fabric_lora_steps(POLICY, hf_dir)
    runs["fabric, no policy"] = _fabric_lora_steps({}, hf_dir)
    return runs


@pytest.mark.timeout(200)
def test_lora_under_an_activation_checkpointing_policy_loads_strictly_and_saves_and_resumes_its_adapters(tmp_path):
    """peft's adapter layers are named as the unwrapped model's: a strict pretrained load (``fit(ckpt_path=<HF
    dir>)``, ``fabric.load_raw``) knows them as adapters the file does not hold, and an adapter-only checkpoint
    resumes exactly, at stages 2 and 3; the policy changes no number."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    LlamaForCausalLM(llama_config(**BASE)).save_pretrained(tmp_path / "hf")
    for runs in run_distributed(
        _lora_under_the_policy, 2, str(tmp_path), str(tmp_path / "hf"), init_process_group=False
    ):
        for stage in (2, 3):
            losses, final, resumed_losses, resumed, checkpointed = runs[stage]
            assert checkpointed == 2  # both decoder layers
            assert resumed_losses == losses[2:]  # bit-identical: base from the directory, adapters from the file
            assert final.keys() == resumed.keys()
            assert all(torch.equal(resumed[k], v) for k, v in final.items())
        torch.testing.assert_close(runs[3][0], runs["no policy"], rtol=1e-5, atol=0)
        fabric_losses, checkpointed = runs["fabric"]
        assert checkpointed == 2
        torch.testing.assert_close(fabric_losses, runs["fabric, no policy"][0], rtol=1e-5, atol=0)
