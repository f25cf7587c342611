"""The models and helpers of the Fabric loops in ``tests/fabric_loop_runs.py``, laid out as the projects whose
loops those are lay theirs out."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger
from torch import Tensor, nn

from lightning_zero.models.gpt import GPT, Block, GPTConfig


class LoopGPT(nn.Module):
    """A GPT laid out as LitGPT's is: ``transformer.wte``/``h``/``ln_f`` and ``lm_head``, a ``config`` attribute, a
    ``max_seq_length`` whose setter rebuilds a position cache buffer (LitGPT's rope cache), no ``reset_parameters``
    of its own, and ``forward(idx, input_pos=None)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                "ln_f": nn.LayerNorm(config.n_embd),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.max_seq_length = config.block_size

    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        if value > self.config.block_size:
            raise ValueError(f"Cannot attend to {value}, block size is only {self.config.block_size}.")
        self._max_seq_length = value
        device = self.lm_head.weight.device
        if device.type == "meta":
            device = torch.device("cpu")
        self.register_buffer("positions", _position_cache(value, self.config.n_embd, device), persistent=False)

    def forward(self, idx: Tensor, input_pos: Tensor | None = None) -> Tensor:
        positions = self.positions[: idx.size(1)] if input_pos is None else self.positions.index_select(0, input_pos)
        x = self.transformer.wte(idx) + positions.to(self.transformer.wte.weight.dtype)
        for block in self.transformer.h:
            x = block(x)
        out: Tensor = self.lm_head(self.transformer.ln_f(x))
        return out


def _position_cache(length: int, width: int, device: torch.device) -> Tensor:
    """Sinusoidal position features (length, width), computed, not learned."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, device=device, dtype=torch.float32) * (-math.log(1e4) / width))
    return torch.cat([torch.sin(position * frequency), torch.cos(position * frequency)], dim=-1)


def initialize_weights(fabric: Fabric, model: nn.Module, n_layer: int, n_embd: int) -> None:
    """LitGPT's pretraining initialization: each layer's ``reset_parameters`` replaced by a scaled normal draw, then
    (unless the strategy materializes from meta itself) run on every module in ``modules()`` order."""

    def init_weights(module: nn.Module, std: float) -> None:
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    for module in model.modules():
        if isinstance(module, nn.Embedding | nn.Linear):
            module.reset_parameters = partial(init_weights, module, std=math.sqrt(2.0 / 5 / n_embd))  # type: ignore[method-assign]
    for module in model.modules():
        if isinstance(module, Block):
            for proj in (module.attn.proj, module.mlp.proj):
                proj.reset_parameters = partial(init_weights, proj, std=1 / math.sqrt(n_embd) / n_layer)  # type: ignore[method-assign]
    if not any(p.is_meta for p in model.parameters()):  # on meta, setup calls them as it materializes
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


class ListLogger(Logger):
    """Keeps what ``fabric.log_dict`` logs (on rank 0, as loggers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def lora_llama() -> nn.Module:
    """The tests' tiny Llama (``tests/third_party_models``) under peft LoRA on q/v: the base frozen by peft."""
    from peft import LoraConfig, get_peft_model

    from tests.third_party_models import _llama

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(_llama(), config)


def lora_filter(key: str, value: Any) -> bool:
    return "lora_" in key


class ScoringGPT(GPT):
    """Our GPT with a method that reads a parameter itself rather than calling its module: the last position's
    hidden state scored against the output embedding."""

    def score(self, idx: Tensor) -> Tensor:
        hidden = self.ln_f(self.wte(idx))[:, -1]
        return hidden @ self.lm_head.weight.t()
