"""The composition matrix's runs, inside ranks started by ``tests.harness.run_distributed(init_process_group=False)``:
one case's model trained through Lightning's ``Trainer`` under DDP (the reference) and under ``ZeroStrategy``.

The models are the third-party fixtures (``tests/third_party_models.py``), with two patterns added here:

- **reentrant checkpointing with a layer shared across segments**: Llama's second decoder layer is its first (one
  module applied twice, ALBERT-style), under Hugging Face's own reentrant checkpointing, so that one layer's
  parameters get gradients from two recomputed segments; the MoE applies one residual block before and after the
  experts, each under ``torch.utils.checkpoint(use_reentrant=True)``. DDP runs the same shared model without
  checkpointing (recomputation changes no number; DDP with reentrant checkpointing and a shared parameter would need
  ``static_graph``, which routing that changes per step rules out);
- **an MoE whose routing changes per step and per rank**: the rank's "domain" feature flips sign every step, so a
  rank's experts {0, 1} at one step are {2, 3} at the next (stage 3 meets experts no rank used in step 1).

Automatic optimization steps one SGD with momentum and two param groups (a gradient off by a factor shows in its
numbers, where Adam would normalize it away); manual optimization uses two optimizers (AdamW for the body, SGD with
momentum for the head), each stepped on its own loss computed under ``LightningOptimizer.toggle_model(sync_grad=...)``
as Lightning documents for GAN-like loops: ``toggle_optimizer`` and, on the non-final micro-batches, ``no_sync``.

In low precision the initial weights are rounded to the parameter dtype for both runs: ZeRO's fp32 masters start from
its bf16/fp16 parameters, so DDP starts from the same point.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_zero import DynamicLossScaler, ZeroPrecision, ZeroStrategy
from lightning_zero.offload import host_copies
from lightning_zero.stage3.secondary_shard import PlainGather
from tests.composition import NA
from tests.third_party_models import SEED, Expert, full_state, hf_causal_lm, hf_lora

STEPS = 3  # optimizer steps per run
CLIP = 0.05  # by norm: below every model's first gradient norm (Llama 1.1, LoRA 0.10, the MoE 4.0), so it clips
FP16_SCALE = 2.0**8  # 16-mixed starts at a scale that overflows in neither DDP nor ZeRO: both skip no step
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
ZEROPP = {
    "off": {"ranks_per_node": 2},
    "hpz": {"ranks_per_node": 2, "hpz_partition_size": 2},
    # int8 in blocks of 64: the tiny models' shards are large enough to be quantized (Note [ZeRO++ on a node
    # topology]); the error bound per element is half a block scale, max|block| / 254.
    "qwz_qgz": {
        "ranks_per_node": 2,
        "quantize_weights": True,
        "quantize_gradients": True,
        "quantization_block": 64,
        "gradient_quantization_bits": 8,
    },
}

Batch = Any
PARAM_DTYPE = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
}


def _generator(rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(20_000 * (rank + 1) + step)


# -- models -----------------------------------------------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + torch.tanh(self.linear(x))
        return out


class VaryingMoE(nn.Module):
    """Top-1 mixture of 4 experts between two residual blocks; with ``shared`` the second block is the first."""

    def __init__(self, shared: bool, width: int = 16) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(2))
        if shared:
            self.blocks[1] = self.blocks[0]
        self.experts = nn.ModuleList(Expert(width, 32) for _ in range(4))
        self.head = nn.Linear(width, 4)
        self.checkpointing = False
        with torch.no_grad():  # feature 0 picks the pair {0, 1} or {2, 3}, feature 1 the expert in it
            self.router.weight.mul_(0.05)
            self.router.weight[:, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0])
            self.router.weight[:, 1] = torch.tensor([1.0, -1.0, 1.0, -1.0])
            self.router.bias.zero_()

    def _block(self, index: int, h: Tensor) -> Tensor:
        block = self.blocks[index]
        if self.checkpointing and torch.is_grad_enabled():
            out: Tensor = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
            return out
        result: Tensor = block(h)
        return result

    def forward(self, x: Tensor) -> Tensor:
        probs = torch.softmax(self.router(x), dim=-1)
        choice = probs.argmax(dim=-1)
        h = self._block(0, self.inp(x))
        mixed = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero(as_tuple=True)[0]
            if rows.numel():
                mixed = mixed.index_add(0, rows, probs[rows, index, None].to(h.dtype) * expert(h[rows]))
        out: Tensor = self.head(self._block(1, h + mixed))
        return out


def _moe_batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    g = _generator(rank, step)
    x = torch.randn(4, 16, generator=g)
    x[:, 0] = 4.0 if (rank + step) % 2 == 0 else -4.0  # experts {0, 1} or {2, 3}, flipping every step
    x[:, 1] *= 3.0
    return x, torch.randn(4, 4, generator=g)


def _mse(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def _llama_of(model: nn.Module) -> nn.Module:
    """The ``LlamaForCausalLM`` inside a peft model, or the model itself."""
    base = getattr(model, "base_model", None)
    inner = getattr(base, "model", None)
    return inner if isinstance(inner, nn.Module) and base is not model else model


def build(
    name: str, shared: bool, checkpointing: bool
) -> tuple[nn.Module, Callable[..., Batch], Callable[..., Tensor]]:
    """(model, batch(rank, step), loss(model, batch)); the same initial weights on every call and rank."""
    if name == "moe":
        torch.manual_seed(SEED)
        moe = VaryingMoE(shared)
        moe.checkpointing = checkpointing
        return moe, _moe_batch, _mse
    fixture = {"hf_causal_lm": hf_causal_lm, "hf_lora": hf_lora}[name]()
    model = fixture.model
    llama: Any = _llama_of(model)
    if shared:
        llama.model.layers[1] = llama.model.layers[0]
        llama.config.use_cache = False  # one layer index twice: a cache would append its keys twice
    if checkpointing:
        llama.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        if name == "hf_lora":  # the frozen embedding's output must require grad to reach the adapters
            llama.enable_input_require_grads()
    return model, fixture.batch, fixture.loss


HEAD = {"hf_causal_lm": "lm_head.", "hf_lora": "v_proj.", "moe": "head."}
"""Parameters whose name contains this go to the head optimizer (or param group); the rest to the body's."""


def _concat(a: Batch, b: Batch) -> Batch:
    if isinstance(a, dict):
        return {k: torch.cat([a[k], b[k]]) for k in a}
    return tuple(torch.cat([x, y]) for x, y in zip(a, b, strict=True))


class _Batches(torch.utils.data.Dataset):
    def __init__(self, batch: Callable[[int, int], Batch], ranks: list[int], length: int) -> None:
        self.batch, self.ranks, self.length = batch, ranks, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Batch:
        out = self.batch(self.ranks[0], index)
        for rank in self.ranks[1:]:  # one rank standing in for several: their batches concatenated
            out = _concat(out, self.batch(rank, index))
        return out


class CompositionModule(pl.LightningModule):
    """One case's model; automatic optimization with two param groups, or manual with two optimizers."""

    def __init__(self, case: dict[str, Any], checkpointing: bool, data_ranks: list[int] | None = None) -> None:
        super().__init__()
        self.case = case
        self.accumulate = case["accumulate"]
        self.automatic_optimization = not case["manual"]
        shared = case["checkpointing"] == "reentrant_shared"
        self.model, self._batch, self._loss = build(case["model"], shared, checkpointing)
        with torch.no_grad():  # representable in the parameter dtype: ZeRO's fp32 masters start from its parameters
            for param in self.model.parameters():
                param.copy_(param.to(PARAM_DTYPE[case["precision"]]))
        self.data_ranks = data_ranks
        self.losses: list[float] = []
        self.comm_hook: Callable[..., Any] | None = None  # for DDP; Lightning registers its own on CUDA only

    def on_fit_start(self) -> None:
        if self.comm_hook is not None:
            self.trainer.strategy.model.register_comm_hook(None, self.comm_hook)  # type: ignore[union-attr]

    def _split(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        head = HEAD[self.case["model"]]
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        return [p for n, p in named if head not in n], [p for n, p in named if head in n]

    def configure_optimizers(self) -> Any:
        body, head = self._split()
        if self.automatic_optimization:  # SGD: a gradient off by a factor shows (Adam would normalize it away)
            return torch.optim.SGD([{"params": body}, {"params": head, "lr": 0.1}], lr=0.05, momentum=0.9)
        return [torch.optim.AdamW(body, lr=1e-2, weight_decay=0.01), torch.optim.SGD(head, lr=0.05, momentum=0.9)]

    def _forward_loss(self, batch: Batch) -> Tensor:
        loss = self._loss(self.model, batch)
        self.losses.append(float(loss.detach().float()))
        return loss

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor | None:
        if self.automatic_optimization:
            return self._forward_loss(batch)
        last = (batch_idx + 1) % self.accumulate == 0
        for optimizer in self.optimizers():  # type: ignore[union-attr]
            with optimizer.toggle_model(sync_grad=last):
                self.manual_backward(self._forward_loss(batch) / self.accumulate)
            if last:
                if self.case["clip"] == "norm":
                    self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
                optimizer.step()
                optimizer.zero_grad()
        return None

    def train_dataloader(self) -> DataLoader:
        ranks = self.data_ranks if self.data_ranks is not None else [self.global_rank]
        return DataLoader(_Batches(self._batch, ranks, STEPS * self.accumulate), batch_size=None)


# -- runs -------------------------------------------------------------------------------------------------------------


def world_size(case: dict[str, Any]) -> int:
    return 4 if case["zeropp"] in ("hpz", "qwz_qgz") else 2


def _precision(case: dict[str, Any], zero: bool) -> dict[str, Any]:
    precision = case["precision"]
    if precision != "16-mixed":
        return {"precision": precision}
    if zero:
        return {"plugins": [ZeroPrecision("16-mixed", loss_scaler=DynamicLossScaler(scale=FP16_SCALE))]}
    # On the CPU, Trainer(precision="16-mixed") would be bf16: fp16 autocast with a grad scaler, explicitly.
    return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=FP16_SCALE))]}


def zero_options(case: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {"stage": case["stage"], "bucket_numel": 2_000, "collective_timeout_s": 60.0}
    if case["optimizer_tier"] != "none":
        options["offload_optimizer"] = "cpu" if case["optimizer_tier"] == "host_copies" else "disk"
    if case["param_tier"] not in (NA, "none"):
        options["offload_params"] = case["param_tier"]
    if case["reshard_root"] != NA:
        options["reshard_root_after_forward"] = case["reshard_root"]
    if case["zeropp"] not in (NA, "off"):
        options.update(ZEROPP[case["zeropp"]])
    if "disk" in (options.get("offload_optimizer"), options.get("offload_params")):
        options["offload_dir"] = "offload"  # under the Trainer's default_root_dir
    return options


def _trainer(case: dict[str, Any], strategy: Any, root: str, zero: bool, devices: int) -> pl.Trainer:
    manual = case["manual"]
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        accumulate_grad_batches=1 if manual else case["accumulate"],
        gradient_clip_val=CLIP if case["clip"] == "norm" and not manual else None,
        gradient_clip_algorithm="norm",
        use_distributed_sampler=False,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **_precision(case, zero),
    )


def fit(
    case: dict[str, Any],
    root: str,
    zero: bool,
    data_ranks: list[int] | None = None,
    compress: bool = False,
    exact_read: bool = False,
    devices: int | None = None,
) -> dict[str, Any]:
    """One fit; ``zero=False`` is the DDP reference (no checkpointing, ``find_unused_parameters`` where needed).
    A setup error is returned as ``error`` with the losses recorded before it (none, if refused before training)."""
    module = CompositionModule(case, checkpointing=zero and case["checkpointing"] != "none", data_ranks=data_ranks)
    initial = {n: p.detach().float().clone() for n, p in module.model.named_parameters()}
    if devices is None:
        devices = 1 if data_ranks is not None else world_size(case)
    unused = case["model"] == "moe" or case["manual"]
    host_copies.FORCE_COPIES = zero and case["optimizer_tier"] == "host_copies"
    try:
        if zero:
            strategy: Any = ZeroStrategy(**zero_options(case))
        else:
            strategy = DDPStrategy(find_unused_parameters=unused, timeout=COLLECTIVE_TIMEOUT)
            module.comm_hook = COMPRESS_HOOKS[case["precision"]] if compress else None
        trainer = _trainer(case, strategy, root, zero, devices)
        trainer.fit(module)
    except Exception as error:  # a refusal is a result; anything else fails the comparison
        where = traceback.format_exc(limit=-6)  # the innermost frames, for the failure message
        return {"error": f"{type(error).__name__}: {error}", "where": where, "losses": module.losses}
    finally:
        host_copies.FORCE_COPIES = False
    gatherer = getattr(trainer.strategy, "_gatherer", None)
    if exact_read and gatherer is not None:  # read the exact shards, not qwZ's int8 gather (measurements only)
        for unit in gatherer.units:
            unit.gather_comm = PlainGather()
    params, _ = full_state(trainer, module.model)
    dtype = next(module.model.parameters()).dtype
    return {"losses": module.losses, "weights": params, "initial": initial, "dtype": dtype}


def ddp_and_zero(case: dict[str, Any], root: str) -> dict[str, Any]:
    """The reference and the case, on the same ranks, data and seed."""
    ddp = fit(case, os.path.join(root, "ddp"), zero=False)
    return {"ddp": ddp, "zero": fit(case, os.path.join(root, "zero"), zero=True)}


def _allreduce_in(dtype: torch.dtype) -> Callable[..., Any]:
    """A DDP communication hook averaging each gradient bucket in ``dtype`` (torch's ``fp16_compress_hook``, for
    any dtype: torch refuses its bf16 one off CUDA)."""

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        buffer = bucket.buffer()
        low = buffer.to(dtype).div_(dist.get_world_size())
        future = dist.all_reduce(low, async_op=True).get_future()  # type: ignore[union-attr]

        def back(done: torch.futures.Future[list[Tensor]]) -> Tensor:
            return buffer.copy_(done.value()[0])

        return future.then(back)

    # DDP checks the annotations themselves, which ``from __future__ import annotations`` turned into strings.
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]}
    return hook


COMPRESS_HOOKS = {"bf16-mixed": _allreduce_in(torch.bfloat16), "16-mixed": _allreduce_in(torch.float16)}


def ddp_compressed(case: dict[str, Any], root: str) -> dict[str, Any]:
    """DDP with its gradients all-reduced in ZeRO's parameter dtype (torch's compression hooks), after plain DDP:
    the rounding ZeRO's mixed precision takes by design (gradients computed, reduced and accumulated in bf16/fp16)."""
    return {
        "plain": fit(case, os.path.join(root, "plain"), zero=False),
        "compressed": fit(case, os.path.join(root, "compressed"), zero=False, compress=True),
    }


def ddp_spread(case: dict[str, Any], root: str) -> dict[str, Any]:
    """DDP on this rank's data (run on 2 ranks), for comparison with :func:`ddp_one_rank`."""
    return fit(case, root, zero=False)


def zero_only(case: dict[str, Any], root: str, exact_read: bool = False, devices: int | None = None) -> dict[str, Any]:
    return fit(case, root, zero=True, exact_read=exact_read, devices=devices)


def ddp_one_rank(case: dict[str, Any], root: str) -> dict[str, Any]:
    """DDP on 1 rank with the global batch of 2 (both ranks' batches concatenated): the same arithmetic as 2 ranks
    up to the order of the sums over the batch, which low precision rounds differently."""
    return fit(case, root, zero=False, data_ranks=[0, 1])
