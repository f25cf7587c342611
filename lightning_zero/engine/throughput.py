"""Throughput of a run: samples and tokens per second, FLOPs per second counted by torch, and MFU.

Note [throughput from the real step]
``StepThroughput`` counts what one rank processes between two optimizer steps: the samples and tokens of every
micro-batch it is given (the batch's first tensor gives the samples, its first integer tensor of two or more
dimensions the tokens), the time from one step to the next (the optimizer's step pre-hook in a Fabric loop;
``on_before_optimizer_step`` under the Trainer, which runs forward and backward inside ``optimizer.step(closure)``,
after the pre-hooks), and the FLOPs of one step, counted by ``FlopCount`` around the real forward and backward of the
first step (no formula of ours: whatever the model computes, by torch's own FLOP formulas; the engine's copies and
collectives count nothing; Note [counting without touching the step]). Under activation checkpointing the
recomputation in backward is counted too, so the utilization is the hardware's (HFU) rather than the model's (MFU);
the report says which. Throughput is taken over the steps after the first (the first pays for the counting and for
the optimizer state's creation). The times are the host's: no device synchronization is added to a step (the engine
already waits once per step, Note [unused parameters]), so over many steps they are the device's. MFU divides the
FLOPs per second by the device's peak for the precision's dtype from Lightning's table (``get_available_flops``:
NVIDIA GPUs, TPUs), or by ``peak_flops`` where given; on a CPU there is none unless given.

Note [counting without touching the step]
The counted step is a training step: counting must not change one bit of it. torch's ``FlopCounterMode`` does: an op
outside its FLOP table that has a ``CompositeImplicitAutograd`` kernel besides its device kernels is re-run through
that decomposition (``func.decompose``, so that FLOPs hidden inside it are seen), and the decomposition rounds
differently from the device kernel. ``silu_backward`` is one (its fused CPU and CUDA kernels against
``math_silu_backward``'s sigmoid, multiplies and adds; about half the elements of a gradient differ by an ulp): the
SwiGLU MLP of every Llama got other gradients on the counted step, so a resume that counted another step than the
run it resumes, or a ZeRO run weighed against a DDP one, no longer matched (``_fused_rms_norm`` on CUDA is another).
``FlopCount`` therefore runs every op as it runs unobserved, ``func(*args)``, and counts by the same table
(``flop_registry``, the formulas ``FlopCounterMode`` uses); where ``FlopCounterMode`` would decompose, it counts the
decomposition on meta copies of the arguments (shapes only: no data, no random numbers drawn, no argument written), so
its total is ``FlopCounterMode``'s while every number computed is the unobserved step's. It keeps no module tracker:
the report needs the total, not a per-module table, and the tracker's global module hooks and gradient hooks on every
module input have no business in the engine's step. A decomposition that cannot run on meta tensors leaves the FLOPs
unknown (the report says which op), never the step changed or stopped; so does a higher-order operator (``torch.cond``,
``flex_attention``), which runs as it does unobserved, its ops below the mode where no count sees them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from torch import Tensor

from lightning_zero.compat import HigherOrderOperator, TorchDispatchMode, flop_registry, tree_flatten, tree_map_only


class ThroughputSummary(NamedTuple):
    """One rank's throughput over the timed steps; the ``global`` figures assume every rank does the same."""

    steps: int
    """Optimizer steps timed (every step after the first)."""
    seconds: float
    samples_per_sec: float
    """All ranks."""
    tokens_per_sec: float | None
    """All ranks; None when the batches hold no token ids."""
    flops_per_step: int | None
    """This rank's FLOPs in one optimizer step (forward and backward of every micro-batch), by torch's FLOP formulas
    (``FlopCount``); None where they could not be counted (``uncounted`` says why)."""
    tflops_per_device: float | None
    peak_tflops: float | None
    """The device's peak for the run's dtype (Lightning's table, or ``peak_flops``); None where unknown."""
    utilization: float | None
    """FLOPs per second over the peak."""
    recomputation: bool
    """Whether activation checkpointing's recomputation is in the count: the utilization is then HFU, not MFU."""
    uncounted: str | None = None
    """Why the FLOPs are unknown (an op whose decomposition could not be counted); None when they were counted."""

    @property
    def utilization_name(self) -> str:
        return "HFU" if self.recomputation else "MFU"

    def metrics(self) -> dict[str, float]:
        """The logger's keys: ``throughput/samples_per_sec``, ``tokens_per_sec``, ``tflops_per_device``, ``mfu``."""
        out = {"throughput/samples_per_sec": self.samples_per_sec}
        if self.tokens_per_sec is not None:
            out["throughput/tokens_per_sec"] = self.tokens_per_sec
        if self.tflops_per_device is not None:
            out["throughput/tflops_per_device"] = self.tflops_per_device
        if self.utilization is not None:
            out[f"throughput/{self.utilization_name.lower()}"] = self.utilization
        return out

    def describe(self) -> str:
        """One paragraph for the end-of-fit table."""
        tokens = "" if self.tokens_per_sec is None else f", {self.tokens_per_sec:,.0f} tokens/s"
        text = f"Throughput over {self.steps} step(s) after the first: {self.samples_per_sec:,.1f} samples/s{tokens} "
        text += "(all ranks)"
        if self.flops_per_step is not None and self.tflops_per_device is not None:
            text += (
                f"; {self.tflops_per_device:.4g} TFLOPS per device ({self.flops_per_step / 1e9:,.2f} GFLOP per step "
                "and rank, counted by torch's FLOP formulas on the first step"
                + (", recomputation included" if self.recomputation else "")
                + ")"
            )
        if self.uncounted is not None:
            text += f"; FLOPs not counted ({self.uncounted}), {self.utilization_name} unknown"
        elif self.utilization is not None and self.peak_tflops is not None:
            text += f"; {self.utilization_name} {100 * self.utilization:.1f}% of {self.peak_tflops:g} TFLOPS"
        else:
            text += f"; {self.utilization_name} unknown: no peak FLOPS for this device (pass peak_flops)"
        return text + "."


_COMPUTE_DTYPES = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the matmuls run in under a Trainer's or Fabric's ``precision``, for the device's peak FLOPS."""
    return _COMPUTE_DTYPES.get(precision, torch.float32)


def batch_sizes(batch: Any) -> tuple[int, int]:
    """(samples, tokens) of a micro-batch: the first tensor's first dimension; the elements of the first integer
    tensor with two or more dimensions (token ids), or 0."""
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, Tensor)]
    if not tensors:
        return 0, 0
    samples = int(tensors[0].shape[0]) if tensors[0].dim() else 1
    ids = next((t for t in tensors if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex()), None)
    return samples, 0 if ids is None else ids.numel()


def _meta_like(tensor: Tensor) -> Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


class FlopCount(TorchDispatchMode):
    """The FLOPs of the ops run while it is entered, as ``FlopCounterMode`` counts them, each op computing exactly what
    it computes unobserved (Note [counting without touching the step])."""

    supports_higher_order_operators = True
    """A higher-order operator (``torch.cond``, ``flex_attention``) reaches ``__torch_dispatch__`` to be run as it runs
    unobserved, rather than stopping the step."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.uncounted: str | None = None
        """The op whose FLOPs could not be counted (a decomposition that does not run on meta tensors, a higher-order
        operator), and why; None while the count is whole."""
        self._whole: set[Any] = {torch.ops.prim.device.default}
        """Ops with no decomposition (``FlopCounterMode`` leaves ``prim.device`` whole too): counted by the table."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):  # its ops run below this mode, unseen: the count is not whole
            self.uncounted = self.uncounted or f"the higher-order operator {func.name()} runs ops no count sees"
            return func(*args, **kwargs)
        # FlopCounterMode's order: an op that decomposes is counted by its parts, any other by the table. The parts
        # are counted before the op runs: an in-place op may resize its arguments.
        decomposed = func not in self._whole and self._count_decomposition(func, args, kwargs)
        out = func(*args, **kwargs)
        formula = None if decomposed else flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out

    def _count_decomposition(self, func: Any, args: Any, kwargs: Any) -> bool:
        """Count the ops ``func`` decomposes into, on meta copies of its arguments (shapes only); False when it has
        no decomposition."""
        if self.uncounted is not None:
            return True  # the total is unknown already: nothing more to count
        try:
            meta_args, meta_kwargs = tree_map_only(Tensor, _meta_like, (args, kwargs))
            with self:
                if func.decompose(*meta_args, **meta_kwargs) is NotImplemented:
                    self._whole.add(func)
                    return False
        except (NotImplementedError, RuntimeError, TypeError) as error:  # no meta kernel, a host read, no strides
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            self.uncounted = f"{func}'s decomposition does not run on meta tensors: {reason}"
        return True


class StepThroughput:
    """What one rank processes per optimizer step, and how fast (Note [throughput from the real step])."""

    def __init__(self, recomputation: bool = False) -> None:
        self.recomputation = recomputation
        self.flops_per_step: int | None = None
        self.uncounted: str | None = None
        self._counter: FlopCount | None = None
        self._done_counting = False
        self._step_times: list[float] = []
        self._samples: list[int] = []
        self._tokens: list[int] = []
        self._pending = (0, 0)

    def on_batch(self, batch: Any) -> None:
        """A micro-batch is about to run forward: count it, and count the FLOPs of the first step."""
        samples, tokens = batch_sizes(batch)
        self._pending = (self._pending[0] + samples, self._pending[1] + tokens)
        if not self._done_counting and self._counter is None:
            self._counter = FlopCount()
            self._counter.__enter__()

    def on_step(self, *_: Any) -> None:
        """The optimizer is about to step: the step's forward and backward are done."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.uncounted = self._counter.uncounted
            self.flops_per_step = self._counter.flops if self.uncounted is None else None
            self._counter = None
            self._done_counting = True
        self._step_times.append(time.perf_counter())
        self._samples.append(self._pending[0])
        self._tokens.append(self._pending[1])
        self._pending = (0, 0)

    def close(self) -> None:
        """Stop counting (a run that ends before its first step)."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    def attach(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Time the steps of the first of ``optimizers`` by its step pre-hook (a loop that calls ``backward`` before
        ``step``, as Fabric loops do), one per step whatever the number of optimizers."""
        for optimizer in optimizers:
            optimizer.register_step_pre_hook(self.on_step)
            return

    def summary(
        self, world_size: int, device: torch.device, dtype: torch.dtype, peak_flops: float | None = None
    ) -> ThroughputSummary | None:
        """The figures over every step after the first; None before two steps."""
        if len(self._step_times) < 2:
            return None
        seconds = self._step_times[-1] - self._step_times[0]
        steps = len(self._step_times) - 1
        samples = sum(self._samples[1:]) * world_size / seconds
        tokens = sum(self._tokens[1:]) * world_size / seconds if any(self._tokens[1:]) else None
        flops = None if self.flops_per_step is None else self.flops_per_step * steps / seconds
        peak = peak_flops if peak_flops is not None else get_available_flops(device, dtype)
        utilization = None if flops is None or not peak else flops / peak
        return ThroughputSummary(
            steps,
            seconds,
            samples,
            tokens,
            self.flops_per_step,
            None if flops is None else flops / 1e12,
            None if not peak else peak / 1e12,
            utilization,
            self.recomputation,
            self.uncounted,
        )
