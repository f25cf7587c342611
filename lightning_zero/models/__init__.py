"""Small reference models trained by the tests, examples and benchmarks."""

from lightning_zero.models.gpt import GPT, Block, CausalSelfAttention, FeedForward, GPTConfig
from lightning_zero.models.lightning_gpt import LitGPT, SyntheticTextDataModule, SyntheticTokenDataset
from lightning_zero.models.mlp import MLP
from lightning_zero.models.param_groups import param_groups_with_weight_decay

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "FeedForward",
    "GPTConfig",
    "LitGPT",
    "SyntheticTextDataModule",
    "SyntheticTokenDataset",
    "param_groups_with_weight_decay",
]
