"""``ZeroStrategy``: ZeRO as a Lightning strategy. Thin glue: the sharding itself lives in ``ZeroOptimizer``.

The lifecycle, in Lightning's hook order:

- ``setup_environment``: initialise the process group (gloo on CPU, nccl on CUDA) from the cluster environment.
- ``setup``: move the module to this rank's device, synchronise it from rank 0, then build the user's optimizers
  (``configure_optimizers``) and wrap each in a ``ZeroOptimizer`` that shards it.
- ``optimizer_step``: the gradient reduction is finished right after the closure (forward + backward), so that
  ``on_before_optimizer_step`` hooks and gradient clipping see the reduced gradients (as the ``ZeroOptimizer``'s
  master gradients, not as parameters' ``.grad``: Note [reduced gradients live in the optimizer] in
  ``trainer/precision.py``); then the sharded step and the parameter all-gather run.
- ``block_backward_sync``: Lightning enters it for the non-final micro-batches of gradient accumulation.

Stage 3 adds: ``model_sharded_context`` (``configure_model``) and ``tensor_init_context``
(``trainer.init_module(empty_init=True)``) build on the meta device; ``setup`` shards the model unit by unit
(``stage3/sharded_init.py``); each ``*_step`` runs with the root unit gathered, as a forward of the root module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager, suppress
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.module_state import ModuleState
from lightning_zero.comm.topology import Link
from lightning_zero.compat import MockOptimizer, sync_module_states
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.buffers import BufferBroadcast
from lightning_zero.engine.grad_norm import hide_partial_gradients
from lightning_zero.engine.memory import ModelStateBytes, communication_per_step, model_state_bytes, tier_bytes
from lightning_zero.engine.model_sharding import (
    full_state_dicts,
    gathered_parameters,
    install_module_state,
    on_meta,
    shard_for_stage3,
    stage3_init_context,
)
from lightning_zero.engine.optimizer_wrapping import as_zero_optimizer, wrap_optimizers
from lightning_zero.engine.presets import StartMethod, register_presets, with_cpu_offload
from lightning_zero.engine.tier_setup import build_memory_tiers, close_memory_tiers, shards_in_memory
from lightning_zero.offload.memory_tiers import MemoryTiers, TierBytes
from lightning_zero.planning.auto_config import Decision
from lightning_zero.sharding.activation_checkpointing import apply_activation_checkpointing_policy
from lightning_zero.stage3.library_init import MetaDeviceExceptMetrics, ParamInitFn, pretrained_on_meta_hint
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from lightning_zero.trainer.auto_setup import choose_configuration
from lightning_zero.trainer.precision import ZeroPrecision, to_zero_precision
from lightning_zero.trainer.root_unit_steps import RootUnitSteps
from lightning_zero.trainer.strategy_checkpoint import iter_zero_optimizers


class ZeroStrategy(RootUnitSteps):
    """Shard optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) across data-parallel ranks.

    Args:
        config: the full ``ZeroConfig``. Alternatively pass its fields as keywords: ``ZeroStrategy(stage=1)``.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: nccl on CUDA, gloo on CPU.
        timeout: overrides ``config.collective_timeout_s``: how long a collective waits for the other ranks.
        start_method: ``"popen"`` re-runs the script per rank (like ``torchrun``); ``"spawn"``/``"fork"``/
            ``"forkserver"`` start ranks with ``multiprocessing`` (notebooks, tests).
        param_init_fn: stage 3, a model built on the meta device in ``configure_model``: how to initialize a
            module's own parameters once allocated. Default: its ``reset_parameters()``.
        cpu_offload: as ``FSDPStrategy(cpu_offload=True)``: the optimizer state and its step in host memory
            (``offload_optimizer="cpu"``) and, at stage 3, the parameter shards too (``offload_params="cpu"``).
    """

    _registered_strategies: ClassVar[list[str]] = []

    strategy_name = "zero"

    def __init__(
        self,
        config: ZeroConfig | None = None,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: StartMethod = "popen",
        param_init_fn: ParamInitFn | None = None,
        cpu_offload: bool | None = None,
        **config_kwargs: Any,
    ) -> None:
        self.config = ZeroConfig.from_arguments(config, config_kwargs)
        if cpu_offload:
            self.config = with_cpu_offload(self.config, config_kwargs if config is None else dataclasses.asdict(config))
        super().__init__(
            timeout=timeout or timedelta(seconds=self.config.collective_timeout_s),
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            start_method=start_method,
        )
        self._param_init_fn = param_init_fn
        self._gatherer: ParameterGatherer | None = None
        self._buffer_broadcast = BufferBroadcast()  # Note [buffers follow rank 0]
        self._tiers: MemoryTiers | None = None
        """This rank's memory tiers (``ZeroConfig.offload_*``), built in ``setup``."""
        self._module_state: ModuleState | None = None
        """Stage 3: the model's own ``state_dict``/``load_state_dict`` (Note [a stage-3 model's state dict])."""
        self.auto_decision: Decision | None = None
        """``stage="auto"``: the configuration chosen when fit started, and the candidates considered."""

    # -- precision: ZeRO's own mixed precision (see ``precision.py``) -----------------------------------------------
    @property
    @override
    def precision_plugin(self) -> ZeroPrecision:
        return self._zero_precision

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning assigns the plugin it built from `Trainer(precision=...)`; we translate it (or refuse it).
        self._zero_precision = to_zero_precision(plugin)
        # The Trainer reads `_precision_plugin` to learn that a plugin was given to the strategy itself; left None,
        # `ZeroStrategy(precision_plugin=...)` would be replaced by the Trainer's default precision without a word.
        self._precision_plugin = self._zero_precision if plugin is not None else None

    # -- model and optimizers ------------------------------------------------------------------------------------
    def _choose_configuration(self, trainer: pl.Trainer, build_model: bool) -> None:
        """``stage="auto"``: replace the config by the chosen one (Note [automatic configuration])."""
        if not self.config.auto:
            return
        assert self.lightning_module is not None
        self.auto_decision = choose_configuration(self, trainer, self.lightning_module, build_model)
        self.config = self.auto_decision.config

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self._choose_configuration(trainer, build_model=False)
        self.accelerator.setup(trainer)
        # A sharded model keeps its layers: Note [teardown keeps the model sharded].
        self.sync_layers(trainer, sharded=self._gatherer is not None)
        assert self.lightning_module is not None
        # Before stage 3 forms its units, so that a checkpointed layer is still a unit (as FSDP's strategy does).
        apply_activation_checkpointing_policy(self.lightning_module, self.config.activation_checkpointing_policy)
        self.model = self.precision_plugin.convert_module(self.model)
        if self._tiers is None:
            self._tiers = build_memory_tiers(self.config, self.lightning_module, trainer.default_root_dir, self)
        if self.config.stage == 3:
            self._shard_model()
            self._broadcast_buffers()  # what _sync_module_states does for stages 1 and 2 (parameters are sharded)
        else:
            self.model_to_device()
            # Parameters are broadcast again bucket by bucket when sharded; buffers (e.g. BatchNorm statistics)
            # only here.
            sync_module_states(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.precision_plugin.after_backward = self._hide_partial_gradients
            self._buffer_broadcast = BufferBroadcast()  # a fresh DDP wrapper's state: Note [buffers follow rank 0]
            self.start_saves()  # Note [asynchronous save]: its process group, before the first step
        self.setup_precision_plugin()

    def _shard_model(self) -> None:
        if self._gatherer is not None:  # fit, then validate/test/predict: already sharded
            return
        assert self.lightning_module is not None
        self.built_on_meta = on_meta(self.lightning_module)
        self._gatherer = shard_for_stage3(self.lightning_module, self.config, self, self._param_init_fn, self._tiers)
        self._module_state = install_module_state(
            self.lightning_module,
            self._gatherer,
            lambda: list(iter_zero_optimizers(self.optimizers)),
            lambda: self._tiers,
        )

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None
        if any(isinstance(o, MockOptimizer) for o in self.optimizers):
            return  # `configure_optimizers` returned None: Lightning trains without an optimizer, as under DDP
        try:
            self.optimizers = list(
                wrap_optimizers(
                    self.lightning_module,
                    self.optimizers,
                    self.process_group,
                    self.config,
                    self.precision_plugin,
                    self._gatherer,
                    self._tiers,
                    self.num_processes,
                )
            )
        except BaseException:
            self.optimizers = []  # refused: the teardown that follows must not take them for sharded ones
            raise

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: ``configure_model`` builds on the meta device; ``setup`` then materializes unit by unit."""
        if self.lightning_module is not None:
            self._choose_configuration(self.lightning_module.trainer, build_model=True)
        if self.config.stage != 3:
            yield
            return
        with MetaDeviceExceptMetrics(), pretrained_on_meta_hint("`configure_model`"):  # Note [metrics stay off meta]
            yield

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` at stage 3 builds on the meta device, as FSDP's strategy does, and
        ``setup`` materializes the model unit by unit with ``configure_model``'s initialization rules (``stage3/
        sharded_init.py``): no rank ever holds the whole model. Stage 3 without ``empty_init`` builds it on the CPU,
        as FSDP's strategy does, and ``setup`` moves it to the device unit by unit as it shards (Note [partly meta
        models]). Stages 1 and 2 behave as DDP: every rank builds the whole model on its device (uninitialized memory
        with ``empty_init=True``, which the broadcast from rank 0 in ``setup`` makes equal on every rank)."""
        if self.config.stage == 3:
            where = "`trainer.init_module(empty_init=True)`"
            with stage3_init_context(self.precision_plugin.tensor_init_context(), empty_init, where):
                yield
            return
        with super().tensor_init_context(empty_init=empty_init):
            yield

    @contextmanager
    def gathered_parameters(
        self, module: torch.nn.Module | None = None, writeback: bool = False
    ) -> Generator[None, None, None]:
        """Full parameters of ``module`` (default: the whole model) on every rank inside the context: for sampling,
        EMA or export. Call it on every rank. With ``writeback=True`` changes to the parameters are kept. Stages 1
        and 2 always hold full parameters, so there it does nothing."""
        models = [(self.lightning_module, self._gatherer)] if self.lightning_module is not None else []
        with gathered_parameters(models, module, writeback):
            yield  # Note [one-rank calls]

    @contextmanager
    def full_state_dict(self, offload_to_cpu: bool = True, rank0_only: bool = False) -> Generator[None, None, None]:
        """Inside the context a stage-3 model's ``state_dict()`` gives full tensors instead of DTensors (on the CPU
        with ``offload_to_cpu``, only on rank 0 with ``rank0_only``): Note [a stage-3 model's state dict]. Call it on
        every rank. Stages 1 and 2 give full tensors always."""
        with full_state_dicts([self._module_state], offload_to_cpu, rank0_only):
            yield

    @contextmanager
    def shards_in_memory(self) -> Generator[None, None, None]:
        """Every shard of this rank (parameters, masters, optimizer state) in memory inside the context, put back
        into its tier afterwards (``ZeroConfig.offload_*``); without tiers it does nothing. Only a swap of the whole
        model needs it (``ShardedEMA``'s validation swap: Note [averages in the tiers]), and it costs this rank's
        model state (16Ψ/N for fp32 Adam), not the tiers' few buckets; checkpoints and ``load_full_state_dict``
        stream through the tiers instead (Note [checkpoints stream through the tiers] in ``checkpoint/tiered.py``)."""
        with shards_in_memory(self._tiers, iter_zero_optimizers(self.optimizers)):
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if isinstance(optimizer, MockOptimizer):  # no optimizer: Lightning's stand-in only runs the closure
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        zero_optimizer = as_zero_optimizer(optimizer)
        if self._tiers is not None and self.lightning_module is not None:
            self._tiers.set_step_number(self.lightning_module.trainer.global_step)  # Note [delayed parameter update]

        def closure_then_reduce() -> Any:
            result = closure()
            zero_optimizer.reduce_gradients()
            hide_partial_gradients([zero_optimizer])  # before on_before_optimizer_step: Note [no partial gradients]
            return result

        return super().optimizer_step(zero_optimizer, closure_then_reduce, model, **kwargs)

    def _hide_partial_gradients(self) -> None:
        hide_partial_gradients(iter_zero_optimizers(self.optimizers))  # Note [no partial gradients]

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with ExitStack() as stack:
            for optimizer in iter_zero_optimizers(self.optimizers):
                stack.enter_context(optimizer.no_sync())
            stack.enter_context(self._buffer_broadcast.no_sync())  # Note [buffers follow rank 0]
            yield

    # -- introspection -------------------------------------------------------------------------------------------
    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's bytes of parameters, gradients, master weights and optimizer state."""
        assert self.lightning_module is not None
        return model_state_bytes(self.lightning_module, iter_zero_optimizers(self.optimizers), self._gatherer)

    def tier_bytes(self) -> TierBytes:
        """This rank's model state by memory tier: in device memory now, placed in the host tier, in the tier file
        on disk (``ZeroConfig.offload_*``)."""
        assert self.lightning_module is not None
        optimizers = iter_zero_optimizers(self.optimizers)
        return tier_bytes(self.config, self.lightning_module, optimizers, self._gatherer, self._tiers)

    def communication_per_step(self, link: Link | None = None) -> dict[str, int]:
        """Bytes this rank sent in the last optimizer step of each optimizer, per collective: in all, or with
        ``link="intra_node"`` / ``"inter_node"`` only those to ranks on its own node / on other nodes (Note [bytes
        by link] in ``comm/ledger.py``)."""
        return communication_per_step(iter_zero_optimizers(self.optimizers), link)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        with suppress(Exception):  # the run's own error is the one to see; the save committed or left nothing
            self.finish_saves()
        close_memory_tiers(self._tiers, None)
        self._tiers = None

    @override
    def teardown(self) -> None:
        """Stages 1 and 2 end like DDP: the module (full parameters on every rank) moves to the CPU.

        Note [teardown keeps the model sharded]
        Lightning's teardown moves the module and the optimizer state to the CPU. For stage 3 that would turn each
        parameter placeholder (one element expanded to the full shape, Note [placeholders]) into a dense full-size
        host tensor on a GPU, the whole model on every rank, and re-point persistent parameters and buffers away
        from the buckets and hooks that own them, so the next ``validate``/``test``/``fit`` on the same module would
        run on detached copies. Stage 3 therefore tears down as FSDP's strategy does: nothing moves, the units stay
        sharded on their device with their hooks, and the next run's ``setup`` finds them as it left them (a new
        ``fit`` builds fresh optimizers over the same shards, as it would for DDP). For the same reason the
        ``SyncBatchNorm`` layers of ``Trainer(sync_batchnorm=True)`` stay (DDP reverts them to BatchNorm): the units
        hold those modules; in evaluation they compute as BatchNorm does.
        """
        self.finish_saves()  # Note [asynchronous save]: committed before fit returns
        self._stop_fault_monitor()
        close_memory_tiers(self._tiers, iter_zero_optimizers(self.optimizers))
        self._tiers = None
        module = self.lightning_module
        if self._gatherer is None and not (module is not None and on_meta(module)):
            for optimizer in iter_zero_optimizers(self.optimizers):
                optimizer.reducer.remove_hooks()
            self.unsync_layers()
            super().teardown()
            return
        # A model still on meta (sharding it failed) cannot move either: moving it would replace the error that
        # stopped the run with "Cannot copy out of meta tensor".
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def get_registered_strategies(cls) -> list[str]:
        """The names this class registered with Lightning (``"zero1"``, ..., the offload presets), as FSDP's."""
        return cls._registered_strategies

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        cls._registered_strategies = register_presets(cls, strategy_registry)
