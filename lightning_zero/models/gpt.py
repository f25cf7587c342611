"""A small GPT-2-style decoder-only transformer (nanoGPT flavour), in plain torch.

Every layer initializes itself (GPT-2's scheme lives in ``GPTLinear`` and ``GPTEmbedding``), so construction draws
random numbers layer by layer in registration order. A model built on the ``meta`` device and materialized later by
calling each layer's ``reset_parameters()`` in that same order, as ZeRO stage 3's sharded init does one unit at a
time, therefore gets bit-identical weights from the same seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape and regularization of a ``GPT``. Validated once, at construction. Presets: ``tiny``, ``small``,
    ``bench25m``."""

    vocab_size: int
    """Number of distinct tokens (rows of the token embedding and outputs of ``lm_head``)."""

    block_size: int
    """Maximum sequence length: the number of learned position embeddings."""

    n_layer: int
    """Number of transformer ``Block``s."""

    n_head: int
    """Attention heads per block; must divide ``n_embd``."""

    n_embd: int
    """Width of the residual stream."""

    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches (training only)."""

    bias: bool = True
    """Whether the Linear layers and LayerNorms carry a bias, as in GPT-2."""

    tie_embeddings: bool = True
    """Share one Parameter between the token embedding and ``lm_head``, as in GPT-2."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Invalid GPTConfig.{name}: {value!r}. Expected a positive integer.")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"Invalid GPTConfig.n_head: {self.n_head!r}. Expected a divisor of n_embd={self.n_embd} "
                "so that every head gets the same width."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Invalid GPTConfig.dropout: {self.dropout!r}. Expected a probability in [0, 1).")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        """120,576 parameters: fast enough for unit tests."""
        return cls(**{**dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64), **overrides})

    @classmethod
    def small(cls, **overrides: Any) -> GPTConfig:
        """3,257,856 parameters: examples and integration tests."""
        return cls(**{**dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256), **overrides})

    @classmethod
    def bench25m(cls, **overrides: Any) -> GPTConfig:
        """25,010,176 parameters (tied embeddings): 6 blocks x 3,152,384 + 11,776 x 512 token embedding
        + 128 x 512 position embedding + 1,024 final LayerNorm. The vocabulary size (a multiple of 128) was picked
        to land at ~25M."""
        return cls(**{**dict(vocab_size=11_776, block_size=128, n_layer=6, n_head=8, n_embd=512), **overrides})


class GPTLinear(nn.Linear):
    """``nn.Linear`` with GPT-2's initialization: weights from N(0, ``init_std``), zero bias."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, init_std: float) -> None:
        self.init_std = init_std  # read by reset_parameters(), which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class GPTEmbedding(nn.Embedding):
    """``nn.Embedding`` with GPT-2's initialization: N(0, 0.02)."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


def _residual_std(config: GPTConfig) -> float:
    # Each block adds two residual branches; scaling their output projections by 1/sqrt(2 * n_layer) keeps the
    # residual stream's variance independent of depth (GPT-2 paper, section 2.3).
    return 0.02 / math.sqrt(2 * config.n_layer)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position attends only to itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.qkv = GPTLinear(config.n_embd, 3 * config.n_embd, bias=config.bias, init_std=0.02)
        self.proj = GPTLinear(config.n_embd, config.n_embd, bias=config.bias, init_std=_residual_std(config))
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        # (B, T, 3C) -> three (B, n_head, T, head_dim) tensors.
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, width)
        out: Tensor = self.resid_dropout(self.proj(y))
        return out


class FeedForward(nn.Module):
    """The position-wise MLP of a block: expand 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = GPTLinear(config.n_embd, 4 * config.n_embd, bias=config.bias, init_std=0.02)
        self.proj = GPTLinear(4 * config.n_embd, config.n_embd, bias=config.bias, init_std=_residual_std(config))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.dropout(self.proj(F.gelu(self.fc(x))))
        return out


class Block(nn.Module):
    """One pre-norm transformer layer. A class of its own because ZeRO stage 3 shards and gathers per ``Block``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        out: Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """Decoder-only language model.

    API: ``forward(idx) -> logits`` of shape (B, T, vocab_size); ``loss(idx, targets) -> scalar`` mean cross
    entropy (it goes through ``forward``, so module hooks installed by a strategy still fire).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = GPTEmbedding(config.vocab_size, config.n_embd)
        self.wpe = GPTEmbedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = GPTLinear(config.n_embd, config.vocab_size, bias=False, init_std=0.02)
        self.tie_weights()

    def iter_blocks(self) -> Iterator[Block]:
        """The blocks, typed as ``Block`` (iterating the ``ModuleList`` directly only promises ``nn.Module``)."""
        for block in self.blocks:
            assert isinstance(block, Block)
            yield block

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very same Parameter as ``wte.weight`` (if tied). Idempotent."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialize every parameter exactly as construction did: each layer in registration order, the tied
        weight keeping the embedding's draw (``lm_head`` still draws its own numbers, as it did when built)."""
        for module in self.modules():
            reset = getattr(module, "reset_parameters", None)
            if module is self or not callable(reset):
                continue
            tied = self.wte.weight.detach().clone() if module is self.lm_head and self.config.tie_embeddings else None
            reset()
            if tied is not None:
                self.wte.weight.copy_(tied)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (B, T) with T <= block_size -> next-token logits (B, T, vocab_size)."""
        seq = idx.size(1)
        if seq > self.config.block_size:
            raise ValueError(
                f"Sequence length {seq} exceeds GPTConfig.block_size={self.config.block_size}. "
                "HINT: crop the input or build the model with a larger block_size."
            )
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.lm_head(self.ln_f(x))
        return logits

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross entropy; ``targets`` (B, T) are usually ``idx`` shifted left by one."""
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T); returns (B, T + max_new_tokens).

        ``temperature=0`` means greedy decoding. ``top_k`` restricts sampling to the k most likely tokens.
        """
        if temperature < 0:
            raise ValueError(f"Invalid temperature: {temperature!r}. Expected >= 0 (0 means greedy).")
        for _ in range(max_new_tokens):
            # The model only knows block_size positions, so condition on the most recent ones.
            logits = self(idx[:, -self.config.block_size :])[:, -1, :]
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth_largest, float("-inf"))
                next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    def num_parameters(self, exclude_tied: bool = True) -> int:
        """Number of parameter elements. ``exclude_tied=True`` counts a shared Parameter once; False counts it once
        per module using it (as if the embeddings were untied)."""
        params = self.parameters() if exclude_tied else (p for _, p in self.named_parameters(remove_duplicate=False))
        return sum(p.numel() for p in params)
