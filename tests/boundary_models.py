"""Small language models with the module shapes fine-tuning code has and our own models lack: frozen layers next to
trainable ones in one unit, adapters on a frozen base, a trainable input embedding before frozen blocks, blocks that
return a dataclass. Each maps tokens (batch, seq) of a 64-token vocabulary to logits; ``tests.parity`` builds them
by name."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

VOCAB, WIDTH, DEPTH = 64, 32, 3


class FrozenNormBlock(nn.Module):
    """A frozen ``LayerNorm`` before a trainable ``Linear``: the input gradient reads the frozen weights."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        nn.init.normal_(self.norm.weight, 1.0, 0.3)  # not the identity: a wrong norm weight must change the result
        self.norm.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.fc(self.norm(x)).tanh()
        return out


class LoraLinear(nn.Module):
    """LoRA as peft builds it: a frozen base ``Linear`` plus a trainable low-rank update."""

    def __init__(self, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(WIDTH, rank, bias=False)
        self.lora_b = nn.Linear(rank, WIDTH, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)  # peft starts at zero; nonzero makes the first step informative

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.base(x) + self.lora_b(self.lora_a(x))
        return out


class LoraBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.norm.requires_grad_(False)
        self.proj = LoraLinear()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.proj(self.norm(x)).relu()
        return out


class FrozenBlock(nn.Module):
    """Every parameter frozen (prompt tuning trains only what feeds the blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.fc(self.norm(x)).tanh()
        return out


@dataclass
class BlockOutput:
    hidden: Tensor
    aux: float = 0.0


class DataclassBlock(nn.Module):
    """Returns a plain dataclass, as many libraries' blocks return output objects."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> BlockOutput:
        return BlockOutput(x + self.fc(x).tanh())


class BlockLM(nn.Module):
    """Embedding -> ``DEPTH`` blocks of one class (each its own stage-3 unit by default) -> head."""

    def __init__(self, block: type[nn.Module], *, train_head: bool = True, train_embedding: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.embed.requires_grad_(train_embedding)
        self.head.requires_grad_(train_head)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            out = block(x)
            x = out.hidden if isinstance(out, BlockOutput) else out
        logits: Tensor = self.head(x)
        return logits


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down(self.up(x).relu())
        return out


class MoEBlock(nn.Module):
    """Top-1 mixture of experts routed by the token ids (so a rank's data decides which experts run). Experts no
    token picks are not called; by the default unit policy each expert is a unit inside the block's unit."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x: Tensor, route: Tensor) -> Tensor:
        h = self.norm(x)
        mixed = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            picked = route == index
            if picked.any():
                mixed = mixed.index_put((picked,), expert(h[picked]))
        return x + mixed


class MoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        route = tokens * 4 // VOCAB  # tokens [0, 16) -> expert 0, [16, 32) -> expert 1, ...
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, route)
        logits: Tensor = self.head(x)
        return logits


def moe_batch(rank: int, step: int, micro: int) -> tuple[Tensor, Tensor]:
    """Rank 0's tokens lie in [0, 32) (experts 0 and 1), rank 1's in [32, 64) (experts 2 and 3); on odd steps each
    rank draws from one quarter only, so its other expert, and every expert of the other rank, goes unused."""
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    span = 32 if step % 2 == 0 else 16
    tokens = 32 * (rank % 2) + torch.randint(0, span, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


BATCHES = {"moe": moe_batch}

BUILDERS = {
    "frozen_norm": lambda: BlockLM(FrozenNormBlock),
    "lora": lambda: BlockLM(LoraBlock, train_head=False, train_embedding=False),
    "prompt_tuning": lambda: BlockLM(FrozenBlock, train_head=False),
    "head_only": lambda: BlockLM(FrozenBlock, train_embedding=False),
    "dataclass_output": lambda: BlockLM(DataclassBlock),
    "moe": MoELM,
}


class Checkpointed(nn.Module):
    """Runs a block under activation checkpointing; reentrant: backward through it is a nested backward."""

    def __init__(self, block: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block = block
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)
        return out


def checkpointed_lm(reentrant: bool) -> BlockLM:
    """Blocks under checkpointing and a frozen head: the first gradient of a backward arrives inside a block."""
    model = BlockLM(FrozenNormBlock, train_head=False)
    model.blocks = nn.ModuleList(Checkpointed(block, reentrant) for block in model.blocks)
    return model


BUILDERS["reentrant"] = lambda: checkpointed_lm(reentrant=True)
BUILDERS["non_reentrant"] = lambda: checkpointed_lm(reentrant=False)
