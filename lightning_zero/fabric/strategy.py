"""``ZeroFabricStrategy``: ZeRO as a Lightning Fabric strategy, the engine's second front door.

Thin glue, in the order a Fabric loop calls it:

- ``launch``/``setup_environment``: Fabric's DDP processes, launcher and process group (this class is a
  ``DDPStrategy`` that never wraps the model in ``DistributedDataParallel``), with ``ZeroConfig``'s collective
  timeout and the fault monitor.
- ``init_module(empty_init=True)``: at stage 3 the model is built on the meta device, as under Fabric's FSDP;
  ``setup_module`` materializes it unit by unit, initialized as the Trainer's ``configure_model`` models are
  (``stage3/sharded_init.py``). Otherwise (stages 1 and 2, or without ``empty_init``) it is DDP's.
- ``setup_module``: stage 3 shards the model; stages 1 and 2 synchronize it from rank 0; it returns the model in a
  ``ZeroForwardModule`` (Note [marked forward methods] in ``fabric/module.py``). Any number of models, each with its
  own units and optimizers (Note [several models in one Fabric] in ``fabric/models.py``). ``setup_optimizer``: each
  optimizer becomes a ``ZeroOptimizer`` over the set-up model (so ``fabric.setup(model, optimizer)`` and
  ``fabric.setup_module`` then ``fabric.setup_optimizers`` both work, at every stage: sharding keeps the parameter
  objects, Note [placeholders] in ``sharding/flat_bucket.py``).
- ``backward`` (``ZeroFabricPrecision``), ``no_backward_sync``, ``clip_gradients_norm``/``_value``: the
  ``ZeroOptimizer``'s reduction, accumulation and clipping over shards (``fabric/gradient_clipping.py``), as the
  Trainer's strategy uses them; between a backward and the step ``.grad`` shows the averaged gradients (Note
  [gradients between backward and step] in ``fabric/visible_gradients.py``).
- ``save_checkpoint``/``load_checkpoint``: the Trainer's sharded directory (``fabric/checkpoint.py``; ``load_raw`` in
  ``fabric/raw_loads.py``), written in the background with ``async_save`` (``fabric/async_saves.py``).
  ``optimizer_step`` counts each optimizer's steps, which end the delayed update's warm-up
  (``fabric/optimizer_steps.py``).

Everything both front doors do to the engine is in ``lightning_zero.engine``, below both.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.accelerators.accelerator import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies.ddp import DDPStrategy
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.compat import FabricSharded
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.fault_watch import FaultWatch
from lightning_zero.engine.grad_norm import hide_partial_gradients
from lightning_zero.engine.model_sharding import (
    full_state_dicts,
    gathered_parameters,
    install_module_state,
    module_state_of,
    on_meta,
    serving,
    stage3_init_context,
)
from lightning_zero.engine.precision import to_zero_precision
from lightning_zero.engine.presets import StartMethod, register_presets
from lightning_zero.engine.rank_layout import world_group
from lightning_zero.engine.throughput import StepThroughput, ThroughputSummary, compute_dtype
from lightning_zero.engine.tier_setup import build_memory_tiers, close_memory_tiers
from lightning_zero.fabric.async_saves import FabricSaves
from lightning_zero.fabric.backward_sync import ZeroBackwardSyncControl
from lightning_zero.fabric.checkpoint import (
    load_fabric_checkpoint,
    refuse_unrestorable_frozen_base,
    save_fabric_checkpoint,
)
from lightning_zero.fabric.gradient_clipping import clip_by_norm, clip_by_value
from lightning_zero.fabric.models import SetUpModel, SetUpModels, refuse_auto, set_up_model, set_up_optimizer
from lightning_zero.fabric.module import full_tensors
from lightning_zero.fabric.optimizer_steps import OptimizerSteps
from lightning_zero.fabric.precision import ZeroFabricPrecision
from lightning_zero.fabric.raw_loads import CheckpointPath, load_raw
from lightning_zero.fabric.visible_gradients import LoopGradients
from lightning_zero.fabric.zero_grad import apply_zero_grad, engine_call, mark, watched
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.sharding.gradient_reducer import GradientReducer
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.library_init import MetaDeviceExceptMetrics, ParamInitFn
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer


class ZeroFabricStrategy(DDPStrategy, FabricSharded):
    """Shard optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) in a Fabric loop.

    Args:
        config: the full ``ZeroConfig`` (the Trainer's ``ZeroStrategy`` takes the same). Alternatively pass its
            fields as keywords: ``ZeroFabricStrategy(stage=3)``.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: nccl on CUDA, gloo on CPU.
        timeout: overrides ``config.collective_timeout_s``.
        start_method: ``"popen"`` re-runs the script per rank (``fabric run``, torchrun); ``"spawn"``/``"fork"``/
            ``"forkserver"`` start ranks with ``multiprocessing`` (``fabric.launch(function)``).
        param_init_fn: stage 3, a model built on meta: how to initialize a module's own parameters once allocated.
            Default: as its library does (``reset_parameters()``, Hugging Face's and peft's initializers).
    """

    def __init__(
        self,
        config: ZeroConfig | None = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: StartMethod = "popen",
        param_init_fn: ParamInitFn | None = None,
        **config_kwargs: Any,
    ) -> None:
        self.config = ZeroConfig.from_arguments(config, config_kwargs)
        refuse_auto(self.config)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout or timedelta(seconds=self.config.collective_timeout_s),
            start_method=start_method,
        )
        self._param_init_fn = param_init_fn
        self.models = SetUpModels()
        """The models set up, each with its units and optimizers (Note [several models in one Fabric] in
        ``fabric/models.py``)."""
        self._backward_sync_control = ZeroBackwardSyncControl(self.models)
        self._loop_gradients = LoopGradients(self.models)  # Note [gradients between backward and step]
        self._tiers: MemoryTiers | None = None
        self._fault_watch = FaultWatch(catch_uncaught=True)  # a Fabric loop's exception reaches no strategy hook
        self.pretrained_source: str | None = None
        """The pretrained weights ``fabric.load_raw`` loaded, recorded by checkpoints that leave frozen parameters
        out (Note [frozen base restored from its source])."""
        self._frozen_base_checked = False
        self._throughput = StepThroughput(recomputation=self.config.activation_checkpointing_policy is not None)
        self.optimizer_steps = OptimizerSteps()  # Note [delayed update in a Fabric loop]
        self.saves = FabricSaves()  # Note [asynchronous saves in a Fabric loop]

    # The first model set up, its units and every optimizer: what a loop with one model reads.
    @property
    def _module(self) -> Module | None:
        return self.models.models[0].module if self.models else None

    @property
    def _gatherer(self) -> ParameterGatherer | None:
        return self.models.models[0].gatherer if self.models else None

    @property
    def _optimizers(self) -> list[ZeroOptimizer]:
        return self.models.optimizers

    @property
    def built_on_meta(self) -> bool:
        """Whether stage 3 built the (first) model on the meta device and initialized it (no weights of its own)."""
        return bool(self.models) and self.models.models[0].built_on_meta

    # -- precision: ZeRO's own (engine/precision.py) -------------------------------------------------------------
    @property
    @override
    def precision(self) -> ZeroFabricPrecision:
        return self._zero_precision

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        # Fabric assigns the plugin it built from `Fabric(precision=...)`; we translate it (or refuse it).
        self._zero_precision = to_zero_precision(precision, ZeroFabricPrecision)
        # Fabric reads `_precision` to learn that the strategy was given a plugin of its own.
        self._precision = self._zero_precision if precision is not None else None

    # -- processes ---------------------------------------------------------------------------------------------------
    @property
    def process_group(self) -> dist.ProcessGroup:
        return world_group()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._fault_watch.start()
        self.saves.start(self.config, self.process_group)  # before the first step: Note [asynchronous save]

    # -- model and optimizers ----------------------------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        if self.config.stage != 3:
            return super().module_init_context(empty_init)
        where = "`fabric.init_module(empty_init=True)`"  # empty: on meta; else on the CPU, as under Fabric's FSDP
        return stage3_init_context(self.precision.module_init_context(), empty_init, where)

    @override
    def module_sharded_context(self) -> AbstractContextManager[Any]:
        return MetaDeviceExceptMetrics() if self.config.stage == 3 else nullcontext()

    @override
    def module_to_device(self, module: Module) -> None:
        # At stage 3 setup_module moves (or allocates) each unit as it shards it: Note [partly meta models].
        if self.config.stage != 3 and not on_meta(module):
            module.to(self.root_device)

    @override
    def setup_module(self, module: Module) -> Module:  # type: ignore[override]  # not wrapped in DDP
        if self.config.exclude_frozen_parameters and self.models:
            raise ValueError(
                f"ZeroConfig.exclude_frozen_parameters=True records one pretrained source per checkpoint, and "
                f"{type(module).__name__} would be the second model set up (after "
                f"{type(self.models.models[0].module).__name__}). HINT: set up one model with this option (a frozen "
                "teacher need not be set up), or set exclude_frozen_parameters=False."
            )
        if self._tiers is None:  # a relative offload_dir is under the working directory
            self._tiers = build_memory_tiers(self.config, module, os.getcwd(), self)
        model = set_up_model(module, self.config, self, self._param_init_fn, self._tiers)
        self.models.models.append(model)
        if model.gatherer is not None:  # Note [a stage-3 model's state dict] in checkpoint/module_state.py
            install_module_state(module, model.gatherer, lambda: model.optimizers, lambda: self._tiers)
        module.register_forward_pre_hook(partial(self._forward_of_the_loop, model), prepend=True)
        self.precision.after_backward = self._hide_partial_gradients
        return model.forward_module

    def _set_up_model(self, module: Any) -> Any:
        """The model for what Fabric hands over of it (Note [marked forward methods] in ``fabric/module.py``)."""
        model = self.models.of(module)
        return module if model is None else model.module

    def _forward_of_the_loop(self, model: SetUpModel, module: Module, args: Any) -> None:
        """Broadcast rank 0's buffers where DDP would (Note [buffers follow rank 0] in ``engine/buffers.py``):
        at the model's first forward, and after a forward with gradients outside its ``no_backward_sync``."""
        model.buffers.before_forward(module, self.process_group, self.config.broadcast_buffers)
        if torch.is_grad_enabled():
            self._throughput.on_batch(args)  # Note [throughput from the real step]

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        zero = set_up_optimizer(
            self.models, optimizer, self.process_group, self.config, self.precision, self._tiers, self.num_processes
        )
        self.models.model_of(zero).watched[id(zero)] = watched(zero)  # Note [model.zero_grad() reaches the shards]
        if len(self._optimizers) == 1:
            self._throughput.attach([zero])
        return zero

    def throughput(self, peak_flops: float | None = None) -> ThroughputSummary | None:
        """Samples, tokens and FLOPs per second and MFU over the steps after the first (``.describe()`` to print,
        ``.metrics()`` for ``fabric.log_dict``); None before two steps. Note [throughput from the real step]."""
        dtype = compute_dtype(str(self.precision.precision))
        return self._throughput.summary(self.world_size, self.root_device, dtype, peak_flops)

    def _hide_partial_gradients(self) -> None:
        hide_partial_gradients(self._optimizers)  # Note [no partial gradients] in engine/grad_norm.py

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        if self.config.exclude_frozen_parameters and not self._frozen_base_checked:
            refuse_unrestorable_frozen_base(self)  # before training, as the Trainer refuses it when fit starts
            self._frozen_base_checked = True
        # Note [gradients between backward and step] in fabric/visible_gradients.py
        self._loop_gradients.apply_zeroing()
        apply_zero_grad(self.models)  # Note [model.zero_grad() reaches the shards] in fabric/zero_grad.py
        self._loop_gradients.hide()
        self._loop_gradients.before_backward()
        try:
            super().backward(tensor, module, *args, **kwargs)
        except BaseException:
            self._loop_gradients.after_backward(refuse=False)
            raise
        self._loop_gradients.after_backward()
        self._loop_gradients.show()
        mark(self.models)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        zero = self.models.optimizer(optimizer)
        if zero is not None:
            self._loop_gradients.apply_zeroing(zero)
            apply_zero_grad(self.models, only=zero)
        with engine_call(self.models), self.optimizer_steps.step(zero) if zero is not None else nullcontext():
            with self._loop_gradients.kept():
                output = super().optimizer_step(optimizer, **kwargs)
            self._loop_gradients.hide(zero)  # the step consumed them: Note [gradients between backward and step]
        return output

    def settle_optimizers(self) -> None:
        """Publish the delayed update still in flight, if any (Note [delayed parameter update] in
        ``offload/host_steps.py``): the weights, masters and moments are then those after every step taken. Call it
        on every rank."""
        for optimizer in self._optimizers:
            optimizer.settle()

    def reducers(self) -> list[GradientReducer]:
        """The gradient reducers of every set-up model."""
        return [r for model in self.models for r in model.reducers()]

    @contextmanager
    def gathered_parameters(self, module: Module | None = None, writeback: bool = False) -> Generator[None, None, None]:
        """Full parameters of ``module`` (a set-up model, or a module of one; default: every set-up model) on every
        rank inside the context: for sampling, EMA or export. Call it on every rank; ``writeback=True`` keeps
        changes. Stages 1 and 2 hold full parameters already."""
        models = [(model.module, model.gatherer) for model in self.models]
        with gathered_parameters(models, self._set_up_model(module), writeback):
            yield  # Note [one-rank calls]

    @contextmanager
    def full_state_dict(self, offload_to_cpu: bool = True, rank0_only: bool = False) -> Generator[None, None, None]:
        """Inside the context a stage-3 model's ``state_dict()`` gives full tensors instead of DTensors (on the CPU
        with ``offload_to_cpu``, only on rank 0 with ``rank0_only``): Note [a stage-3 model's state dict]. Call it on
        every rank. Stages 1 and 2 give full tensors always."""
        self.settle_optimizers()
        with full_state_dicts((module_state_of(m.module) for m in self.models), offload_to_cpu, rank0_only):
            yield

    # -- the barrier first serves a rank calling a model alone (Note [one-rank calls]) ------------------------------
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with serving(m.gatherer for m in self.models):
            super().barrier(*args, **kwargs)

    # -- clipping over shards (fabric/gradient_clipping.py) -----------------------------------------------------------
    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        return clip_by_norm(self.models, self._loop_gradients, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        clip_by_value(self.models, self._loop_gradients, optimizer, clip_val)

    # -- checkpoints: the Trainer's sharded directory (fabric/checkpoint.py) -----------------------------------------
    @override
    def save_checkpoint(
        self,
        path: CheckpointPath,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Every rank writes what it owns into the directory ``path``; call it on every rank."""
        if storage_options is not None:
            raise TypeError(
                f"ZeroFabricStrategy.save_checkpoint(storage_options={storage_options!r}) is not supported: sharded "
                "checkpoints are written by every rank, not through a CheckpointIO plugin. HINT: drop storage_options."
            )
        state = {name: self._set_up_model(value) for name, value in state.items()}
        self.settle_optimizers()  # Note [delayed update in a Fabric loop]
        if any(m.gatherer is not None for m in self.models):
            state = full_tensors(state)  # a state dict taken as DTensors is saved whole, as DDP's
        save_fabric_checkpoint(self, self.broadcast(path), state, filter or {})

    @override
    def load_checkpoint(
        self,
        path: CheckpointPath,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a sharded directory (any world size or stage, a Fabric's or a Trainer's) or one file into the objects
        of ``state``: any part of what was saved. A module or an optimizer alone (``fabric.load_raw``) takes a raw
        state-dict file.

        Always as ``weights_only=True`` would (Note [safe loading] in ``checkpoint/files.py``).
        """
        self.saves.wait()  # the checkpoint may be the one in flight: Note [asynchronous saves in a Fabric loop]
        self.settle_optimizers()  # Note [delayed update in a Fabric loop]
        path = self.broadcast(path)
        if isinstance(state, Module | Optimizer):
            load_raw(self, path, self._set_up_model(state), strict)
            return {}
        state = {} if state is None else state
        for name, value in state.items():  # in place: Fabric copies the plain entries back from this dictionary
            state[name] = self._set_up_model(value)
        return load_fabric_checkpoint(self, path, state, strict)

    # -- end ---------------------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        try:
            self.saves.finish()  # committed, or its error raised: Note [asynchronous saves in a Fabric loop]
        finally:
            self._fault_watch.stop()
            close_memory_tiers(self._tiers, self._optimizers)
            self._tiers = None
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_presets(cls, strategy_registry)
