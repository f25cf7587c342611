"""``ZeroFabricStrategy``: ZeRO as a Lightning Fabric strategy, the engine's second front door.

Thin glue, in the order a Fabric loop calls it:

- ``launch``/``setup_environment``: Fabric's DDP processes, launcher and process group (this class is a
  ``DDPStrategy`` that never wraps the model in ``DistributedDataParallel``), with ``ZeroConfig``'s collective
  timeout and the fault monitor.
- ``init_module(empty_init=True)``: at stage 3 the model is built on the meta device, as under Fabric's FSDP;
  ``setup_module`` materializes it unit by unit, initialized as the Trainer's ``configure_model`` models are
  (``stage3/sharded_init.py``). Otherwise (stages 1 and 2, or without ``empty_init``) it is DDP's.
- ``setup_module``: stage 3 shards the model; stages 1 and 2 synchronize it from rank 0; it returns the model in a
  ``ZeroForwardModule`` (Note [marked forward methods] in ``fabric/module.py``). ``setup_optimizer``: each
  optimizer becomes a ``ZeroOptimizer`` over the set-up model (so ``fabric.setup(model, optimizer)`` and
  ``fabric.setup_module`` then ``fabric.setup_optimizers`` both work, at every stage: sharding keeps the parameter
  objects, Note [placeholders] in ``sharding/flat_bucket.py``).
- ``backward`` (``ZeroFabricPrecision``), ``no_backward_sync``, ``clip_gradients_norm``/``_value``: the
  ``ZeroOptimizer``'s reduction, accumulation and clipping over shards, as the Trainer's strategy uses them.
- ``save_checkpoint``/``load_checkpoint``: the Trainer's sharded directory (``fabric/checkpoint.py``).

Everything both front doors do to the engine is in ``lightning/engine_setup.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from types import TracebackType
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

from lightning_zero.comm.fault_monitor import FaultMonitor
from lightning_zero.compat import FabricSharded, sync_module_states
from lightning_zero.config import ZeroConfig
from lightning_zero.fabric.backward_sync import ZeroBackwardSyncControl
from lightning_zero.fabric.checkpoint import (
    CheckpointPath,
    load_fabric_checkpoint,
    load_raw,
    refuse_unrestorable_frozen_base,
    save_fabric_checkpoint,
)
from lightning_zero.fabric.module import ZeroForwardModule, load_state_dict_into_shards, refuse_released_parameters
from lightning_zero.fabric.precision import ZeroFabricPrecision
from lightning_zero.lightning.engine_setup import broadcast_buffers, shard_for_stage3, wrap_optimizers
from lightning_zero.lightning.grad_norm import hide_partial_gradients
from lightning_zero.lightning.offload_setup import build_memory_tiers
from lightning_zero.lightning.precision import to_zero_precision
from lightning_zero.lightning.presets import register_presets
from lightning_zero.lightning.strategy_checkpoint import as_zero_optimizer
from lightning_zero.lightning.strategy_processes import StartMethod
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.sharding.activation_checkpointing import apply_activation_checkpointing_policy
from lightning_zero.sharding.gradient_reducer import GradientReducer
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.library_init import ParamInitFn, pretrained_on_meta_hint
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
        if self.config.offload_overlap == "delayed":
            raise NotImplementedError(
                "ZeroFabricStrategy with offload_overlap='delayed' is not implemented: the delayed update starts "
                "after a warm-up counted by the Trainer's global_step, which a Fabric loop does not have. HINT: use "
                "offload_overlap='exact' with Fabric, or ZeroStrategy with the Trainer."
            )
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
        self._backward_sync_control = ZeroBackwardSyncControl(self)
        self._param_init_fn = param_init_fn
        self._module: Module | None = None
        """The model set up (one per strategy: the checkpoint format holds one model)."""
        self._forward_module: ZeroForwardModule | None = None
        """What ``setup_module`` returned for it (Note [marked forward methods] in ``fabric/module.py``)."""
        self._gatherer: ParameterGatherer | None = None
        self._optimizers: list[ZeroOptimizer] = []
        self._tiers: MemoryTiers | None = None
        self._fault_monitor: FaultMonitor | None = None
        self._excepthook: Callable[[type[BaseException], BaseException, TracebackType | None], Any] | None = None
        self._broadcast_next_forward = True  # Note [buffers follow rank 0] in lightning/strategy.py
        self._accumulating = False  # inside no_backward_sync
        self.pretrained_source: str | None = None
        """The pretrained weights ``fabric.load_raw`` loaded, recorded by checkpoints that leave frozen parameters
        out (Note [frozen base restored from its source])."""
        self.built_on_meta = False
        """Whether stage 3 built the model on the meta device and initialized it (no weights of its own)."""
        self._frozen_base_checked = False

    # -- precision: ZeRO's own (lightning/precision.py) -------------------------------------------------------------
    @property
    @override
    def precision(self) -> ZeroFabricPrecision:
        return self._zero_precision

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        # Fabric assigns the plugin it built from `Fabric(precision=...)`; we translate it (or refuse it).
        zero_precision = to_zero_precision(precision, ZeroFabricPrecision)
        assert isinstance(zero_precision, ZeroFabricPrecision)
        self._zero_precision = zero_precision
        # Fabric reads `_precision` to learn that the strategy was given a plugin of its own.
        self._precision = self._zero_precision if precision is not None else None

    # -- processes ---------------------------------------------------------------------------------------------------
    @property
    def process_group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD
        assert group is not None, "the process group is created in setup_environment()"
        return group

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._fault_monitor is None:
            # Names the rank that failed, died or hangs in the errors of the others (comm/fault_monitor.py). A
            # Fabric loop's exception reaches no strategy hook, so the monitor sees it as it leaves the script.
            self._fault_monitor = FaultMonitor.from_default_group()
            if self._fault_monitor is not None:
                self._fault_monitor.start()
                self._excepthook = sys.excepthook
                sys.excepthook = self._on_uncaught_exception

    def _on_uncaught_exception(
        self, kind: type[BaseException], exception: BaseException, traceback: TracebackType | None
    ) -> Any:
        if self._fault_monitor is not None:
            self._fault_monitor.on_exception(exception)  # adds the note naming the rank at fault
        previous = self._excepthook or sys.__excepthook__
        return previous(kind, exception, traceback)

    # -- model and optimizers ----------------------------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        if self.config.stage != 3 or not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))  # materialized unit by unit in setup_module
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(pretrained_on_meta_hint("`fabric.init_module(empty_init=True)`"))
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager[Any]:
        return torch.device("meta") if self.config.stage == 3 else nullcontext()

    @override
    def module_to_device(self, module: Module) -> None:
        if not _on_meta(module):  # a model on meta is allocated on the device by setup_module
            module.to(self.root_device)

    @override
    def setup_module(self, module: Module) -> Module:  # type: ignore[override]  # not wrapped in DDP
        if self._module is not None:
            raise ValueError(
                f"ZeroFabricStrategy sets up one model, and {type(self._module).__name__} was set up already. HINT: "
                "put the models in one `nn.Module` and set that up, or use one Fabric per model."
            )
        if self.config.stage != 3 and _on_meta(module):
            raise ValueError(
                f"{type(module).__name__} has parameters on the meta device, which only stage 3 materializes. HINT: "
                "build it under `fabric.init_module(empty_init=False)` (or without it) at stages 1 and 2, or use "
                "stage 3."
            )
        self._module = module
        # Before stage 3 forms its units, so that a checkpointed layer is still a unit (as under the Trainer).
        apply_activation_checkpointing_policy(module, self.config.activation_checkpointing_policy)
        if self._tiers is None:  # a relative offload_dir is under the working directory
            self._tiers = build_memory_tiers(
                self.config,
                module,
                os.getcwd(),
                self.global_rank,
                self.root_device,
                self.world_size,
                self.num_processes,
            )
        if self.config.stage == 3:
            self.built_on_meta = _on_meta(module)
            self._gatherer = shard_for_stage3(
                module,
                self.config,
                self.process_group,
                self.root_device,
                self.num_processes,
                self._param_init_fn,
                self._tiers,
            )
            broadcast_buffers(module, self.process_group)
            # Note [load_state_dict into shards] in fabric/module.py
            module.load_state_dict = partial(load_state_dict_into_shards, self)  # type: ignore[method-assign]
        else:
            module.to(self.root_device)
            # Parameters are broadcast again bucket by bucket when an optimizer shards them; buffers only here.
            sync_module_states(module)
        module.register_forward_pre_hook(self._forward_of_the_loop, prepend=True)
        self.precision.after_backward = self._hide_partial_gradients
        self._forward_module = ZeroForwardModule(module)
        return self._forward_module

    def _set_up_model(self, module: Any) -> Any:
        """The model for what Fabric hands over of it (Note [marked forward methods] in ``fabric/module.py``)."""
        return self._module if module is self._forward_module and module is not None else module

    def _forward_of_the_loop(self, module: Module, args: Any) -> None:
        """Broadcast rank 0's buffers where DDP would (Note [buffers follow rank 0] in ``lightning/strategy.py``):
        at the first forward, and after a forward with gradients outside ``no_backward_sync``."""
        if self._broadcast_next_forward and self.config.broadcast_buffers:
            broadcast_buffers(module, self.process_group)
        self._broadcast_next_forward = torch.is_grad_enabled() and not self._accumulating

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._module is None:
            raise RuntimeError(
                "ZeroFabricStrategy wraps an optimizer over a set-up model. HINT: call `fabric.setup(model, "
                "optimizer)`, or `model = fabric.setup_module(model)` before `fabric.setup_optimizers(optimizer)`."
            )
        optimizers: list[Optimizer] = [*self._optimizers, optimizer]
        self._optimizers = wrap_optimizers(
            self._module,
            optimizers,
            self.process_group,
            self.config,
            self.precision,
            self._gatherer,
            self._tiers,
            self.num_processes,
        )
        return self._optimizers[-1]

    def _hide_partial_gradients(self) -> None:
        hide_partial_gradients(self._optimizers)  # Note [no partial gradients] in lightning/grad_norm.py

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        if self.config.exclude_frozen_parameters and not self._frozen_base_checked:
            refuse_unrestorable_frozen_base(self)  # before training, as the Trainer refuses it when fit starts
            self._frozen_base_checked = True
        super().backward(tensor, module, *args, **kwargs)

    def reducers(self) -> list[GradientReducer]:
        """The gradient reducers of the set-up model: stage 3's (shared by its optimizers), or each optimizer's."""
        found = [o.reducer for o in self._optimizers]
        if self._gatherer is not None:
            found.append(self._gatherer.reducer)
        return list({id(r): r for r in found}.values())

    @contextmanager
    def gathered_parameters(self, module: Module | None = None, writeback: bool = False) -> Generator[None, None, None]:
        """Full parameters of ``module`` (default: the whole model) on every rank inside the context: for sampling,
        EMA or export. Call it on every rank; ``writeback=True`` keeps changes. Stages 1 and 2 hold full parameters
        already."""
        if self._gatherer is None:
            yield
            return
        with self._gatherer.gathered(self._set_up_model(module), writeback=writeback):
            yield

    # -- clipping over shards (Note [reduced gradients live in the optimizer] in lightning/precision.py) -------------
    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        zero = as_zero_optimizer(optimizer)
        norm = zero.clip_grad_norm_(float(max_norm), float(norm_type))
        # A step that overflowed under loss scaling is skipped by every rank: its norm is expected to be infinite.
        if error_if_nonfinite and not zero._found_inf and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        return norm

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        as_zero_optimizer(optimizer).clip_grad_value_(float(clip_val))

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
        if self._module is not None and self._gatherer is not None:
            refuse_released_parameters(state, self._module)
        save_fabric_checkpoint(self, self.broadcast(path), state, filter or {})

    @override
    def load_checkpoint(
        self,
        path: CheckpointPath,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a sharded directory (any world size or stage, a Fabric's or a Trainer's) or a full ``.ckpt`` file
        into the objects of ``state``; a module alone (``fabric.load_raw``) takes a full state-dict file.

        Always as ``weights_only=True`` would (Note [safe loading] in ``checkpoint/files.py``).
        """
        path = self.broadcast(path)
        if isinstance(state, Module):
            load_raw(self, path, self._set_up_model(state), strict)
            return {}
        if isinstance(state, Optimizer) or not state:
            raise ValueError(
                f"ZeroFabricStrategy.load_checkpoint(state={type(state).__name__}) cannot restore that: optimizer "
                "state is sharded with the model. HINT: pass the objects together, "
                "`fabric.load(path, {'model': model, 'optimizer': optimizer, ...})`."
            )
        for name, value in state.items():  # in place: Fabric copies the plain entries back from this dictionary
            state[name] = self._set_up_model(value)
        return load_fabric_checkpoint(self, path, state, strict)

    # -- end ---------------------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        if self._fault_monitor is not None:
            self._fault_monitor.stop()
            self._fault_monitor = None
        if self._excepthook is not None:
            sys.excepthook = self._excepthook
            self._excepthook = None
        if self._tiers is not None:
            self._tiers.restore()
            self._tiers.close()
            self._tiers = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_presets(cls, strategy_registry)


def _on_meta(module: Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))
