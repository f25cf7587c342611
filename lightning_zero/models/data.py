"""``ByteCorpusDataModule``: a text file as byte-level language-model data (vocabulary of 256, no tokenizer).

Bytes rather than characters: any file works, nothing needs to be fitted or shipped besides the text, and a model
with ``vocab_size=256`` (the ``tiny`` and ``small`` GPT presets) covers every input.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 256


def encode(text: str) -> Tensor:
    """UTF-8 bytes of ``text`` as a (len,) int64 tensor of token ids."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: Tensor) -> str:
    """Token ids back to text; a sample cut in the middle of a multi-byte character shows a replacement mark."""
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


class ByteWindowDataset(Dataset[tuple[Tensor, Tensor]]):
    """Windows of ``seq_len + 1`` bytes starting every ``stride`` bytes; item ``i`` is ``(window[:-1], window[1:])``."""

    def __init__(self, data: Tensor, *, seq_len: int, stride: int) -> None:
        if data.numel() < seq_len + 1:
            raise ValueError(
                f"Text of {data.numel()} bytes is too short for seq_len={seq_len}. HINT: use a longer text or a "
                "smaller model.config.block_size."
            )
        self.data = data  # (num_bytes,) uint8: 8x smaller than int64; converted per window
        self.seq_len = seq_len
        self.starts = range(0, data.numel() - seq_len, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = self.starts[index]
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class ByteCorpusDataModule(pl.LightningDataModule):
    """Train on the first ``1 - val_fraction`` of a text file's bytes, validate on the rest.

    Training windows do not overlap (``stride = seq_len``) and are shuffled; under distributed training Lightning's
    ``DistributedSampler`` (seeded, so every run sees the same order) gives each rank its own share.
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        *,
        path: str | Path,
        seq_len: int,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"ByteCorpusDataModule: no text file at path={str(self.path)!r}. HINT: pass an existing file, e.g. "
                "data.path=/abs/path/to/text.txt (relative paths are resolved by the caller)."
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"Invalid val_fraction: {val_fraction!r}. Expected a fraction in (0, 1).")
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(
                f"Invalid ByteCorpusDataModule sizes: seq_len={seq_len!r}, batch_size={batch_size!r}. "
                "Expected positive integers."
            )
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        # A few hundred KB: read eagerly so a bad file fails before any process is launched.
        data = torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8)
        split = int(data.numel() * (1.0 - val_fraction))
        self.train_set = ByteWindowDataset(data[:split], seq_len=seq_len, stride=seq_len)
        self.val_set = ByteWindowDataset(data[split:], seq_len=seq_len, stride=seq_len)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        # drop_last: every step sees a full batch, so per-step losses are comparable across strategies.
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
