"""``ProcessPerDevice``: the processes under ``ZeroStrategy``, one per device, as ``DDPStrategy`` has them.

What every ZeRO stage shares with DDP and nothing of ZeRO itself: the launcher (a re-run script per rank, like
``torchrun``, or ``multiprocessing``), the topology Lightning asks a strategy for (nodes, processes, the sampler's
shard of the data), the process group created from the cluster environment with its collective timeout, the
collectives Lightning calls on a strategy (barrier, broadcast, reduce of logged metrics) and the fault monitor that
names a rank that failed, died or hangs (``comm/fault_monitor.py``), and ``Trainer(sync_batchnorm=True)``'s layer
conversion. ``ShardedCheckpointing``
(``strategy_checkpoint.py``) and ``ZeroStrategy`` (``strategy.py``) build on it.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only  # type: ignore[attr-defined]
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed import ReduceOp
from typing_extensions import override

from lightning_zero.compat import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    default_process_group_backend_for_device,
    distributed_is_initialized,
    init_dist_connection,
    layer_sync,
    sync_ddp_if_available,
)
from lightning_zero.engine.fault_watch import FaultWatch
from lightning_zero.engine.model_sharding import serving
from lightning_zero.engine.presets import StartMethod
from lightning_zero.engine.rank_layout import world_group

log = logging.getLogger(__name__)


class ProcessPerDevice(ParallelStrategy):
    """One process per device in one process group, launched and torn down as Lightning's ``DDPStrategy`` does.

    Args:
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: nccl on CUDA, gloo on CPU.
        timeout: how long a collective waits for the other ranks.
        start_method: ``"popen"`` re-runs the script per rank (like ``torchrun``); ``"spawn"``/``"fork"``/
            ``"forkserver"`` start ranks with ``multiprocessing`` (notebooks, tests).
    """

    def __init__(
        self,
        *,
        timeout: timedelta,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: StartMethod = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"Invalid ZeroStrategy start_method: {start_method!r}. Expected 'popen', 'spawn', 'fork' or "
                "'forkserver'."
            )
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method: StartMethod = start_method
        self._num_nodes = 1
        self._fault_watch = FaultWatch()
        self._layers_synced = False
        """``sync_layers`` converted the model for this fit; ``unsync_layers`` reverts it."""

    # -- topology ----------------------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this to decide whether to give each rank its own DistributedSampler
        # shard of the data; without it every rank would silently train on the same batches.
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def process_group(self) -> dist.ProcessGroup:
        return world_group()

    # -- processes and their group -------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = FullWeightsLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        """This process's global rank and the world size, from the cluster environment (as DDP's and FSDP's)."""
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or default_process_group_backend_for_device(
            self.root_device
        )
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        assert self.cluster_environment is not None
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if "nccl" in self._process_group_backend and os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0":
            # See "Faults on NCCL" in docs/faults.md: without error handling nothing ever ends a hung collective.
            log.warning(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a collective whose peer died or hangs will block this rank "
                "forever; `collective_timeout_s` (%s s) only takes effect with error handling on. HINT: unset it "
                "(torch's default tears the process down once the timeout expires).",
                self._timeout.total_seconds(),
            )
        # Names the rank that failed, died or hangs in the errors of the others (see ``comm/fault_monitor.py``).
        self._fault_watch.start()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._fault_watch.on_exception(exception)

    def _stop_fault_monitor(self) -> None:
        self._fault_watch.stop()

    # -- Trainer(sync_batchnorm=True) ---------------------------------------------------------------------------------
    def sync_layers(self, trainer: pl.Trainer, sharded: bool = False) -> None:
        """Before fitting, apply Lightning's layer sync (BatchNorm -> SyncBatchNorm) as ``DDPStrategy.setup`` does,
        and refuse it where DDP refuses it. Call before the model is moved, converted to a precision or sharded;
        ``sharded``: it was sharded already (its layers cannot be replaced any more)."""
        sync = layer_sync(self)
        if trainer.state.fn != TrainerFn.FITTING or sync is None:
            return
        assert self.model is not None
        if sharded:
            unsynced = [n for n, m in self.model.named_modules() if type(m) in _BATCH_NORMS]
            if unsynced:
                raise ValueError(
                    f"Trainer(sync_batchnorm=True) cannot convert {unsynced[0]!r} and the other BatchNorm layers of a "
                    "model that stage 3 sharded in an earlier validate/test/predict: its sharded units hold those "
                    "layers. HINT: fit before evaluating, or fit a freshly built model."
                )
            return
        self.model = sync.apply(self.model)
        self._layers_synced = True
        refuse_sync_batchnorm_on_cpu(self.model, self.root_device)

    def unsync_layers(self) -> None:
        """After a fit that converted the model, convert it back, as ``DDPStrategy.teardown`` does."""
        sync = layer_sync(self)
        if self._layers_synced and sync is not None and self.model is not None:
            self.model = sync.revert(self.model)
        self._layers_synced = False

    # -- collectives Lightning asks of a strategy ----------------------------------------------------------------
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not distributed_is_initialized():
            return
        with serving([getattr(self, "_gatherer", None)]):  # Note [one-rank calls]
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor


class FullWeightsLauncher(MultiProcessingLauncher):
    """Lightning's launcher for ``start_method="spawn"`` (and the other ``multiprocessing`` ones), handing the main
    process full weights.

    Note [spawned ranks return full weights]
    After ``fit`` in spawned processes, Lightning's launcher takes ``lightning_module.state_dict()`` on every rank,
    saves rank 0's to a file and loads it into the main process's model with ``strict=False``. At stage 3 that state
    dict holds DTensors of each rank's rows (Note [a stage-3 model's state dict]), which the main process, with no
    process group, cannot read; so the launcher takes it inside ``full_state_dict(rank0_only=True)``: rank 0 gets full
    CPU tensors, gathered bucket by bucket, and the main process DDP's weights (the fp32 masters' values under mixed
    precision, as DDP's parameters are fp32)."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        full_state_dict = getattr(self._strategy, "full_state_dict", None)
        with full_state_dict(rank0_only=True) if full_state_dict is not None else nullcontext():
            return super()._collect_rank_zero_results(trainer, results)


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
"""The layers ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` replaces."""


def refuse_sync_batchnorm_on_cpu(module: nn.Module, device: torch.device) -> None:
    """DDP's refusal (``DistributedDataParallel._passing_sync_batchnorm_handle``): torch's ``SyncBatchNorm`` has no
    CPU kernels, and its forward refuses a CPU input."""
    if device.type != "cpu":
        return
    for name, layer in module.named_modules():
        if isinstance(layer, nn.SyncBatchNorm):
            raise ValueError(
                f"SyncBatchNorm layers only work with GPU modules ({name!r} is on the CPU). HINT: drop "
                "`Trainer(sync_batchnorm=True)` on the CPU, or train on GPUs."
            )
