"""Small language models with the module shapes fine-tuning code has and our own models lack: frozen layers next to
trainable ones in one unit, adapters on a frozen base, a trainable input embedding before frozen blocks, blocks that
return a dataclass. Each maps tokens (batch, seq) of a 64-token vocabulary to logits; ``tests.parity`` builds them
by name."""

from __future__ import annotations

from dataclasses import dataclass

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


BUILDERS = {
    "frozen_norm": lambda: BlockLM(FrozenNormBlock),
    "lora": lambda: BlockLM(LoraBlock, train_head=False, train_embedding=False),
    "prompt_tuning": lambda: BlockLM(FrozenBlock, train_head=False),
    "head_only": lambda: BlockLM(FrozenBlock, train_embedding=False),
    "dataclass_output": lambda: BlockLM(DataclassBlock),
}
