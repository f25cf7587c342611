"""Reference training loops for parity tests: the same model, data and optimizer under DDP and under ZeRO.

Everything here runs inside a rank started by ``tests.harness.run_distributed``; results come back as plain lists and
tensors so that the assertions (and their messages) live in the test, in the parent process.

Both collective modes: ``ddp_and_zero`` trains the ZeRO model a second time with ``LIGHTNING_ZERO_NATIVE_COLLECTIVES=1``
(the branch NCCL takes, Note [native collectives] in ``lightning_zero/comm/collectives.py``) and ``assert_runs_match``
checks that run against DDP too, so every parity test covers both modes for the cost of one more ZeRO run per rank
(no new processes). ``LIGHTNING_ZERO_NATIVE_COLLECTIVES`` set for the whole test session runs everything natively.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_zero import ZeroConfig, ZeroOptimizer
from lightning_zero.comm.collectives import NATIVE_COLLECTIVES_ENV, native_collectives
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.models.mlp import MLP
from lightning_zero.models.param_groups import param_groups_with_weight_decay
from lightning_zero.stage3.sharded_init import shard_module
from tests.boundary_models import BATCHES as BOUNDARY_BATCHES
from tests.boundary_models import BUILDERS as BOUNDARY_MODELS
from tests.harness import run_distributed

Batch = tuple[Tensor, Tensor]


class TorchTransformerLM(nn.Module):
    """A language model on ``nn.TransformerEncoder``: its attention (``nn.MultiheadAttention``) reads
    ``out_proj.weight`` without calling ``out_proj``, the case stage 3's wrap policy must respect."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
        out: Tensor = self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))
        return out


class CheckpointedBlock(nn.Module):
    """Runs a GPT block under non-reentrant activation checkpointing: backward re-runs its forward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return out


def build_model(name: str) -> nn.Module:
    torch.manual_seed(1234)
    if name in BOUNDARY_MODELS:
        return BOUNDARY_MODELS[name]()
    if name == "mlp":
        return MLP(in_features=12, hidden=(32, 24), out_features=5)
    if name == "transformer":
        return TorchTransformerLM()
    if name == "gpt_checkpointed":
        gpt = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))
        gpt.blocks = nn.ModuleList(CheckpointedBlock(b) for b in gpt.blocks)
        return gpt
    if name == "gpt":
        # No biases: a key-projection bias has a mathematically zero gradient (softmax ignores a per-row shift),
        # so its computed gradient is rounding noise whose sign depends on the summation order of the reduction,
        # and Adam scales that noise into full-size steps. Any two correct reductions with different orders (our
        # all-to-all sum vs gloo's ring) then disagree on that one tensor; it says nothing about ZeRO.
        return GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))
    raise ValueError(name)


def build_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        groups = param_groups_with_weight_decay(model, 0.1)
        return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
    if name == "plain_sgd":  # no momentum, no decay: a parameter with a zero gradient does not move
        return torch.optim.SGD(model.parameters(), lr=0.05)
    if name == "sgd":
        # Two param groups with different hyper-parameters: the no-decay group also gets its own learning rate.
        groups = param_groups_with_weight_decay(model, 1e-2, no_decay_overrides={"lr": 0.02})
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    raise ValueError(name)


def batch(model_name: str, rank: int, step: int, micro: int) -> Batch:
    if model_name in BOUNDARY_BATCHES:
        return BOUNDARY_BATCHES[model_name](rank, step, micro)
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    if model_name == "mlp":
        return torch.randn(6, 12, generator=g), torch.randn(6, 5, generator=g)
    tokens = torch.randint(0, 64, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model_name: str, model: nn.Module, data: Batch) -> Tensor:
    x, y = data
    if model_name == "mlp":
        return nn.functional.mse_loss(model(x), y)
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    weights: dict[str, Tensor] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def train(
    model_name: str,
    optimizer_name: str,
    steps: int,
    accumulate: int,
    wrap: Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, Any]],
) -> Run:
    """Train ``steps`` optimizer steps of ``accumulate`` micro-batches; ``wrap`` makes (forward module, optimizer)."""
    rank = dist.get_rank()
    model = build_model(model_name)
    forward, optimizer = wrap(model, build_optimizer(optimizer_name, model))
    run = Run()
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for micro in range(accumulate):
            last = micro == accumulate - 1
            context = optimizer_no_sync(forward, optimizer) if not last else nullcontext()
            with context:
                loss = loss_fn(model_name, forward, batch(model_name, rank, step, micro)) / accumulate
                loss.backward()
            total += loss.item()
        optimizer.step()
        run.losses.append(total)
    run.weights = full_weights(model, optimizer)
    return run


def full_weights(model: nn.Module, optimizer: Any) -> dict[str, Tensor]:
    """Every parameter in full, on every rank (stage 3 gathers them for the copy)."""
    gatherer = getattr(optimizer, "gatherer", None)
    context = gatherer.gathered() if gatherer is not None else nullcontext()
    with context:
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def optimizer_no_sync(forward: nn.Module, optimizer: Any) -> Any:
    if isinstance(forward, DistributedDataParallel):
        return forward.no_sync()
    return optimizer.no_sync()


def ddp(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    return DistributedDataParallel(model), optimizer


def zero(config: ZeroConfig) -> Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, ZeroOptimizer]]:
    def wrap(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, ZeroOptimizer]:
        return model, ZeroOptimizer(model, optimizer, dist.group.WORLD, config)

    return wrap


def zero3(config: ZeroConfig) -> Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, ZeroOptimizer]]:
    """Stage 3 at the core level: shard the built model unit by unit, then wrap the optimizer over the shards."""

    def wrap(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, ZeroOptimizer]:
        gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
        return model, ZeroOptimizer(model, optimizer, dist.group.WORLD, config, gatherer=gatherer)

    return wrap


@contextmanager
def native_collectives_on() -> Iterator[None]:
    """Inside, every collective of this process takes its native (NCCL) branch, also on gloo."""
    previous = os.environ.get(NATIVE_COLLECTIVES_ENV)
    os.environ[NATIVE_COLLECTIVES_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[NATIVE_COLLECTIVES_ENV]
        else:
            os.environ[NATIVE_COLLECTIVES_ENV] = previous


def ddp_and_zero(model_name: str, optimizer_name: str, steps: int, accumulate: int, config: ZeroConfig) -> list[Run]:
    """One rank's [DDP run, ZeRO run] with identical seeds and data; the ZeRO run carries a second one with native
    collectives in ``extra["native"]`` (see the module docstring)."""
    reference = ddp_only(model_name, optimizer_name, steps, accumulate)
    return [reference, zero_only(model_name, optimizer_name, steps, accumulate, config)]


def ddp_only(model_name: str, optimizer_name: str, steps: int, accumulate: int) -> Run:
    """``ddp_and_zero``'s DDP run alone: a reference several ZeRO configurations can share (it depends on none)."""
    return train(model_name, optimizer_name, steps, accumulate, ddp)


def zero_only(model_name: str, optimizer_name: str, steps: int, accumulate: int, config: ZeroConfig) -> Run:
    """``ddp_and_zero``'s ZeRO run alone, with its native-collective twin in ``extra["native"]``."""
    wrap = zero3(config) if config.stage == 3 else zero(config)
    sharded = train(model_name, optimizer_name, steps, accumulate, wrap)
    if dist.get_world_size() > 1 and not native_collectives():  # one rank: no collective has two branches
        with native_collectives_on():
            sharded.extra["native"] = train(model_name, optimizer_name, steps, accumulate, wrap)
    return sharded


@functools.cache
def ddp_reference(world_size: int, model_name: str, optimizer_name: str, steps: int, accumulate: int) -> list[Run]:
    """Each rank's ``ddp_only`` run, trained once per test session: every test comparing a ZeRO configuration with
    the same DDP run (another stage, another option) reads it from here. Runs in the test process, not in a rank."""
    return run_distributed(ddp_only, world_size, model_name, optimizer_name, steps, accumulate)


def assert_zero_matches_ddp(
    world_size: int, model_name: str, optimizer_name: str, steps: int, accumulate: int, config: ZeroConfig
) -> None:
    """``ddp_and_zero`` and ``assert_runs_match`` on every rank, the DDP side from ``ddp_reference``."""
    sharded = run_distributed(zero_only, world_size, model_name, optimizer_name, steps, accumulate, config)
    reference = ddp_reference(world_size, model_name, optimizer_name, steps, accumulate)
    for expected, run in zip(reference, sharded, strict=True):
        assert_runs_match(expected, run)


def assert_runs_match(reference: Run, candidate: Run, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same losses at every step and same final weights; also for the native-collective run the candidate carries."""
    native = candidate.extra.get("native")
    if native is not None:
        assert_runs_match(reference, native, rtol, atol)
    torch.testing.assert_close(
        torch.tensor(candidate.losses), torch.tensor(reference.losses), rtol=rtol, atol=atol, msg="per-step losses"
    )
    assert candidate.weights.keys() == reference.weights.keys()
    for name, expected in reference.weights.items():
        torch.testing.assert_close(candidate.weights[name], expected, rtol=rtol, atol=atol, msg=f"final {name}")
