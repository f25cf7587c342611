"""The example models and data: trained by the examples, the tests and the benchmarks.

- ``gpt``: a small GPT (``GPTConfig``), ``lightning_gpt``: ``LitGPT`` and synthetic token data around it.
- ``mlp``: a plain MLP; ``param_groups``: weight-decay param groups; ``data``: the byte-level corpus data module.

They are ordinary PyTorch / Lightning code that knows nothing of ZeRO.

May import: nothing of lightning_zero but this package
"""

from lightning_zero.models.data import ByteCorpusDataModule
from lightning_zero.models.gpt import GPT, Block, CausalSelfAttention, FeedForward, GPTConfig
from lightning_zero.models.lightning_gpt import LitGPT, SyntheticTextDataModule, SyntheticTokenDataset
from lightning_zero.models.mlp import MLP
from lightning_zero.models.param_groups import param_groups_with_weight_decay

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "ByteCorpusDataModule",
    "CausalSelfAttention",
    "FeedForward",
    "GPTConfig",
    "LitGPT",
    "SyntheticTextDataModule",
    "SyntheticTokenDataset",
    "param_groups_with_weight_decay",
]
