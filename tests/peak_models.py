"""LightningModules whose peak memory is predicted and measured: the project's GPT, a Hugging Face Llama and a peft
LoRA of it, each built in ``configure_model`` (on meta at stage 3) and each with its own training data, so that
``python -m lightning_zero estimate --model tests.peak_models.LlamaModule`` and a Trainer run the same step.

Sized so that a rank's peak is tens of MB (well above the few MB of noise in a process's resident memory) and a
step takes a fraction of a second on a CPU.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_zero.models.gpt import GPTConfig
from lightning_zero.models.lightning_gpt import LitGPT, SyntheticTokenDataset


class _Tokens(Dataset[dict[str, Tensor]]):
    def __init__(self, num: int, seq_len: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (num, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class GPTModule(LitGPT):
    """``LitGPT`` with a data loader of its own: ``n_embd`` wide, ``n_layer`` deep, micro-batches of ``batch_size``
    sequences of 128 tokens."""

    def __init__(self, n_layer: int = 4, n_embd: int = 256, batch_size: int = 8, lr: float = 1e-3) -> None:
        super().__init__(GPTConfig.small(n_layer=n_layer, n_embd=n_embd), lr=lr)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader[Any]:
        data = SyntheticTokenDataset(num_samples=64, seq_len=self.config.block_size, vocab_size=self.config.vocab_size)
        return DataLoader(data, batch_size=self.batch_size, shuffle=False, drop_last=True)


class LlamaModule(pl.LightningModule):
    """A Hugging Face ``LlamaForCausalLM`` (``lora=True``: peft's LoRA on ``q_proj``/``v_proj``, the base frozen),
    trained with AdamW on fixed random tokens."""

    def __init__(
        self,
        hidden: int = 256,
        layers: int = 4,
        vocab: int = 2048,
        seq_len: int = 128,
        batch_size: int = 8,
        lora: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import LlamaConfig, LlamaForCausalLM

        h = self.hparams
        config = LlamaConfig(
            vocab_size=h.vocab,
            hidden_size=h.hidden,
            intermediate_size=h.hidden * 8 // 3,
            num_hidden_layers=h.layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=h.seq_len,
            attn_implementation="eager",
            use_cache=False,  # training: a cache would append the keys again when a checkpointed layer recomputes
        )
        model = LlamaForCausalLM(config)
        if h.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        self.model = model

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        h = self.hparams
        return DataLoader(_Tokens(64, h.seq_len, h.vocab), batch_size=h.batch_size, drop_last=True)


MODELS: dict[str, tuple[type[pl.LightningModule], dict[str, Any]]] = {
    "gpt": (GPTModule, {}),
    "llama": (LlamaModule, {}),
    "lora": (LlamaModule, {"lora": True}),
}
"""The three models of the prediction's checks, by name: class and init args."""

TINY: dict[str, dict[str, Any]] = {
    "gpt": {"n_layer": 1, "n_embd": 32, "batch_size": 2},
    "llama": {"hidden": 32, "layers": 1, "vocab": 64, "batch_size": 2},
    "lora": {"hidden": 32, "layers": 1, "vocab": 64, "batch_size": 2, "lora": True},
}
"""Each model's class at a tiny size: a process runs it once before measuring (``tests/peak_runs.py``)."""

CHECKPOINTED = {"gpt": ("Block",), "llama": ("LlamaDecoderLayer",), "lora": ("LlamaDecoderLayer",)}
"""The layer class each model checkpoints with ``activation_checkpointing_policy``."""
