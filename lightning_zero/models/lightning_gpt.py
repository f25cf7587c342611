"""``LitGPT``: the GPT as a LightningModule, plus a synthetic, file-free text data module to train it on."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.models.param_groups import param_groups_with_weight_decay


class LitGPT(pl.LightningModule):
    """Trains a ``GPT`` with AdamW (two param groups: decayed matrices / undecayed biases and norms).

    The GPT is built in ``configure_model()`` rather than ``__init__`` so that a strategy can build it inside its own
    init context (target device, dtype, ``meta`` for sharded init). Until then ``model`` is None.
    """

    def __init__(
        self,
        config: GPTConfig | Mapping[str, Any],
        *,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        # A mapping is what ``load_from_checkpoint`` passes back from the saved hyper-parameters.
        self.config = config if isinstance(config, GPTConfig) else GPTConfig(**config)
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = (float(betas[0]), float(betas[1]))
        # Plain types only: Lightning loads checkpoints with ``torch.load(weights_only=True)`` by default, which
        # refuses to unpickle arbitrary classes such as GPTConfig.
        self.save_hyperparameters(
            {"config": dataclasses.asdict(self.config), "lr": lr, "weight_decay": weight_decay, "betas": self.betas}
        )
        self.model: GPT | None = None

    def configure_model(self) -> None:
        # Lightning calls this hook at the start of every fit/validate/test/predict; rebuilding would throw away the
        # trained weights.
        if self.model is not None:
            return
        self.model = GPT(self.config)

    @property
    def gpt(self) -> GPT:
        """The built model; raises if ``configure_model()`` has not run yet."""
        if self.model is None:
            raise RuntimeError(
                "LitGPT.model has not been built yet. HINT: the Trainer calls configure_model() for you; "
                "outside a Trainer, call lit_gpt.configure_model() first."
            )
        return self.model

    def forward(self, idx: Tensor) -> Tensor:
        logits: Tensor = self.gpt(idx)
        return logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self.gpt.loss(inputs, targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self.gpt.loss(inputs, targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = param_groups_with_weight_decay(self.gpt, self.weight_decay)
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)


class SyntheticTokenDataset(Dataset[tuple[Tensor, Tensor]]):
    """``num_samples`` deterministic pseudo-random token sequences, each an arithmetic progression
    ``start, start + step, start + 2 * step, ... (mod vocab_size)`` with a random start and a step in 1..8.

    Unlike uniform noise this is learnable (the step can be read off the context), so training loss falls well below
    ``log(vocab_size)`` within a few steps. Item ``i`` is ``(tokens[:-1], tokens[1:])``, both ``seq_len`` long.
    """

    def __init__(self, *, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        if num_samples <= 0 or seq_len <= 0 or vocab_size <= 0:
            raise ValueError(
                f"Invalid SyntheticTokenDataset sizes: num_samples={num_samples!r}, seq_len={seq_len!r}, "
                f"vocab_size={vocab_size!r}. Expected positive integers."
            )
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        # A private generator: the data depends on ``seed`` alone, not on (and without disturbing) the global RNG.
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, vocab_size, (num_samples,), generator=generator)
        self.steps = torch.randint(1, 9, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        tokens = (self.starts[index] + self.steps[index] * torch.arange(self.seq_len + 1)) % self.vocab_size
        return tokens[:-1], tokens[1:]


class SyntheticTextDataModule(pl.LightningDataModule):
    """Train/validation loaders over ``SyntheticTokenDataset`` (different seeds, so validation is unseen data).

    Not shuffled, so every run (and every strategy) sees the same batches in the same order; under distributed
    training Lightning's ``DistributedSampler`` splits them across ranks.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        batch_size: int = 8,
        num_train: int = 512,
        num_val: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        # Cheap (two small integer tensors each), so built eagerly rather than in ``setup()``.
        self.train_set = SyntheticTokenDataset(num_samples=num_train, seq_len=seq_len, vocab_size=vocab_size, seed=seed)
        self.val_set = SyntheticTokenDataset(num_samples=num_val, seq_len=seq_len, vocab_size=vocab_size, seed=seed + 1)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        # drop_last: every step sees a full batch, which keeps step-by-step comparisons between strategies exact.
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False, drop_last=True)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False)
