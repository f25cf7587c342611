"""Pretrained weights from the files people have: a Hugging Face model's ``save_pretrained`` directory (one
safetensors file, or shards with an index) and a ``.safetensors`` file, loaded into a ZeRO model at every stage (built
on meta at stage 3) through ``fit(ckpt_path=...)`` or ``load_full_state_dict``; the weights equal ``from_pretrained``
and training matches DDP started from ``from_pretrained``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

import lightning_zero
from lightning_zero import ZeroConfig, ZeroOptimizer, ZeroStrategy
from lightning_zero.checkpoint.files import CheckpointError
from tests.harness import run_distributed

VOCAB, SEQ, STEPS = 64, 12, 3


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "tie_word_embeddings": True,  # save_pretrained stores the tied head once
        "attn_implementation": "eager",
        **overrides,
    }
    return LlamaConfig(**settings)


def save_pretrained(root: Path, **config: Any) -> dict[str, Path]:
    """The same pretrained weights as one safetensors file and as shards of a few KB with an index."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    model = LlamaForCausalLM(llama_config(**config))
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    return {"single": root / "single", "sharded": root / "sharded", "file": root / "single" / "model.safetensors"}


class Tokens(Dataset[dict[str, Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        tokens = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": tokens, "labels": tokens.clone()}


class FineTune(pl.LightningModule):
    """``self.model`` is a Hugging Face causal LM: from ``from_pretrained`` in ``__init__`` (the DDP reference) or
    built from its config in ``configure_model`` (on meta at stage 3), its weights from ``fit(ckpt_path=...)``."""

    def __init__(self, pretrained: str | None = None) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.model: nn.Module | None = None
        if pretrained is not None:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(pretrained)
        self.losses: list[float] = []
        self.at_start: dict[str, Tensor] = {}

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import LlamaForCausalLM

            self.model = LlamaForCausalLM(llama_config())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None
        loss: Tensor = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return DataLoader(Tokens(), batch_size=4)

    def on_train_start(self) -> None:
        self.at_start = full_state(self)


def full_state(module: pl.LightningModule) -> dict[str, Tensor]:
    strategy = module.trainer.strategy
    gathered = strategy.gathered_parameters(module) if isinstance(strategy, ZeroStrategy) else None
    if gathered is None:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    with gathered:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fit(strategy: Any, module: FineTune, ckpt_path: str | None) -> tuple[list[float], dict[str, Tensor], dict]:
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module.losses, module.at_start, full_state(module)


def _fit_from_pretrained(sources: dict[str, str], stage: int, source: str) -> Any:
    return _fit(ZeroStrategy(stage=stage, bucket_numel=2_000), FineTune(), sources[source])


def _fit_ddp_from_pretrained(single: str) -> Any:
    return _fit("ddp", FineTune(single), None)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``save_pretrained``'s checkpoints, written once for every case of the test below."""
    return {k: str(v) for k, v in save_pretrained(tmp_path_factory.mktemp("pretrained")).items()}


@functools.cache
def _ddp_from_pretrained(single: str) -> list[Any]:
    """Every rank's DDP run from ``from_pretrained``: no case changes it, so the three share it."""
    return run_distributed(_fit_ddp_from_pretrained, 2, single, init_process_group=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stage", "source"), [(1, "file"), (2, "single"), (3, "sharded")])
def test_fit_from_a_hugging_face_checkpoint_matches_ddp_from_from_pretrained(pretrained, stage, source):
    ranks = run_distributed(_fit_from_pretrained, 2, pretrained, stage, source, init_process_group=False)
    for (ddp_losses, ddp_start, ddp_end), (losses, start, end) in zip(
        _ddp_from_pretrained(pretrained["single"]), ranks, strict=True
    ):
        assert start.keys() == ddp_start.keys()
        for key, value in ddp_start.items():  # from_pretrained's weights, tied head included
            assert torch.equal(start[key], value), key
        torch.testing.assert_close(losses, ddp_losses, rtol=1e-5, atol=0)
        for key, value in ddp_end.items():
            torch.testing.assert_close(end[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _load_into_held_model(source: str, prefix: str | None) -> list[str]:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(dist.get_rank())
    config = ZeroConfig(stage=2)
    holder = nn.Module()
    holder.model = LlamaForCausalLM(llama_config())
    optimizer = ZeroOptimizer(holder, torch.optim.SGD(holder.parameters(), lr=0.1), dist.group.WORLD, config)
    lightning_zero.load_full_state_dict(holder, source, optimizers=[optimizer], prefix=prefix)
    expected = AutoModelForCausalLM.from_pretrained(Path(source).parent if source.endswith(".safetensors") else source)
    return [k for k, v in expected.state_dict().items() if not torch.equal(holder.model.state_dict()[k], v)]


@pytest.mark.timeout(60)
def test_load_full_state_dict_finds_the_prefix_of_a_held_model_and_names_mismatched_keys(tmp_path):
    sources = save_pretrained(tmp_path)
    for differing in run_distributed(_load_into_held_model, 2, str(sources["sharded"]), None):
        assert differing == []
    for differing in run_distributed(_load_into_held_model, 2, str(sources["file"]), "model."):
        assert differing == []
    # A file of another configuration: the error names missing and unexpected keys and how to fix them.
    other = save_pretrained(tmp_path / "other", num_hidden_layers=3)
    holder = nn.Module()
    from transformers import LlamaForCausalLM

    holder.model = LlamaForCausalLM(llama_config())
    with pytest.raises(
        CheckpointError, match=r"unexpected key\(s\) in the file \[.model\.layers\.2\..*HINT: pass `prefix=`"
    ):
        lightning_zero.load_full_state_dict(holder, other["single"])
    with pytest.raises(CheckpointError, match=r"without model.safetensors.*HINT"):
        lightning_zero.load_full_state_dict(holder, tmp_path)


class PretrainedInConfigureModel(FineTune):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(self.path)


def _from_pretrained_in_configure_model(path: str) -> str:
    try:
        _fit(ZeroStrategy(stage=3), PretrainedInConfigureModel(path), None)
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(90)
def test_from_pretrained_in_configure_model_at_stage_3_is_refused_with_the_way_to_load_pretrained_weights(tmp_path):
    # transformers refuses from_pretrained on meta (the weights would be lost); the refusal says what to do instead.
    sources = save_pretrained(tmp_path)
    for message in run_distributed(_from_pretrained_in_configure_model, 2, str(sources["single"])):
        assert "from_pretrained" in message, message
        assert "HINT: build it from its config" in message, message
        assert "ckpt_path=path" in message, message
