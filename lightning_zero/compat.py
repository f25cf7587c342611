"""Every private torch and Lightning API the package relies on, in one place, for every version it declares.

``pyproject.toml`` declares ``torch>=2.6`` and ``lightning>=2.4``. Private names move between releases without notice,
so nothing else in the package imports from a private module or calls a private function of torch or Lightning: it
imports the name from here, where one line per version difference adapts it. ``tests/test_compat.py`` names each one
and checks that it resolves on the installed versions; a release that moves one fails there, not in a training run.

Like ``config.py``, this module imports nothing of ``lightning_zero``, and every subpackage may import it.

What differs across the declared range (checked on torch 2.6.0, 2.7.0 and 2.13 with Lightning 2.4.0 and 2.6):

- DCP's ``_write_item`` takes ``(stream, data, item, key)`` on torch 2.6, the writer's ``transforms`` first from
  2.7, and its ``serialization_format`` last from 2.8 (``write_dcp_item``); ``SerializationFormat`` itself is 2.8's.
- DCP's file writer hands its queue of files to an overridable ``_write_data`` from 2.7 only
  (``DCP_WRITER_HAS_WRITE_DATA``); torch 2.6 writes them in ``write_data`` itself.
- ``UntypedStorage._swap_data_ptr_`` is newer than 2.7 (``SWAPS_STORAGE_MEMORY``).
- DCP's ``load`` takes ``no_dist`` from 2.7; on 2.6 a load by one process inside a process group goes through the
  older ``load_state_dict``, which does (``dcp_load``).

Not routed here, but named and checked in ``tests/test_compat.py`` too: the methods and attributes that Lightning's
``Strategy`` and ``Precision`` let a subclass override or set (``_configure_launcher``, ``_launcher``,
``_precision_plugin``, ``_clip_gradients``), and attributes of torch's own objects read or set where the object is
(an optimizer's hook registries, a storage's ``_cdata``, a tensor's ``_version``, an RNN's flat weights,
``MultiheadAttention._reset_parameters``).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded, _validate_keys_for_strict_loading
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from torch import Tensor
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo, _write_item
from torch.distributed.checkpoint.planner import LoadPlanner, WriteItem
from torch.distributed.checkpoint.state_dict_loader import load, load_state_dict
from torch.distributed.checkpoint.storage import StorageReader, WriteResult
from torch.distributed.distributed_c10d import _get_default_store
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._device import DeviceContext as _DeviceContext
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils._pytree import tree_map as _tree_map
from torch.utils.flop_counter import flop_registry

__all__ = [
    "CHECKPOINT_WRAPPER_PREFIX",
    "DCP_WRITER_HAS_WRITE_DATA",
    "SWAPS_STORAGE_MEMORY",
    "CheckpointWrapper",
    "DeviceContext",
    "DtypeContextManager",
    "FabricBackwardSyncControl",
    "FabricSharded",
    "FabricStateful",
    "FakeTensorMode",
    "FsspecReader",
    "FsspecWriter",
    "HigherOrderOperator",
    "MockOptimizer",
    "ModTracker",
    "MultiProcessingLauncher",
    "PrefixStore",
    "StorageInfo",
    "Store",
    "SubprocessScriptLauncher",
    "TCPStore",
    "TorchDispatchMode",
    "apply_activation_checkpointing",
    "at_threading_shutdown",
    "batches_that_stepped",
    "broadcast_coalesced",
    "checkpoint_wrapper",
    "convert_fp_tensor",
    "current_autograd_node",
    "current_graph_task_id",
    "dcp_load",
    "default_process_group_backend_for_device",
    "device_constructors",
    "disabled_torch_function_impl",
    "distributed_is_initialized",
    "dtensor_over",
    "fabric_run_command",
    "flop_registry",
    "fused_adam_kernel",
    "get_default_store",
    "init_dist_connection",
    "layer_sync",
    "local_tensor_of",
    "make_wrapper_subclass",
    "non_finite_check_and_unscale_",
    "open_torch_save_archive",
    "queue_autograd_callback",
    "rebuild_tensor",
    "route_checkpoint_model_state",
    "storage_type",
    "swap_storage_memory",
    "sync_ddp_if_available",
    "sync_module_states",
    "training_dataloader",
    "tree_flatten",
    "tree_map",
    "tree_map_only",
    "validate_keys_for_strict_loading",
    "write_dcp_item",
    "writes_torch_save",
]

# -- torch.distributed.checkpoint ------------------------------------------------------------------------------------
# FsspecWriter / FsspecReader: DCP's fsspec storage (local paths and remote URLs alike); DCP does not re-export them.
StorageInfo = _StorageInfo
"""Where one DCP record lives in a checkpoint's files (``.metadata``'s ``storage_data`` values)."""

_FILESYSTEM = importlib.import_module("torch.distributed.checkpoint.filesystem")
_SERIALIZATION_FORMAT: Any = getattr(_FILESYSTEM, "SerializationFormat", None)  # torch >= 2.8
_WRITE_ITEM_PARAMETERS = tuple(inspect.signature(_write_item).parameters)
DCP_WRITER_HAS_WRITE_DATA = hasattr(_FILESYSTEM._FileSystemWriter, "_write_data")
"""DCP's file writer writes its queue of files through ``_write_data`` (torch >= 2.7)."""


def write_dcp_item(writer: Any, stream: Any, data: Tensor | Any, item: WriteItem, storage_key: str) -> WriteResult:
    """DCP's ``_write_item`` of one record into ``stream``, as ``writer`` (a DCP file writer) would call it."""
    if _WRITE_ITEM_PARAMETERS[0] != "transforms":  # torch 2.6
        return _write_item(stream, data, item, storage_key)  # type: ignore[call-arg, arg-type]
    if "serialization_format" in _WRITE_ITEM_PARAMETERS:  # torch >= 2.8
        return _write_item(writer.transforms, stream, data, item, storage_key, writer.serialization_format)
    return _write_item(writer.transforms, stream, data, item, storage_key)  # type: ignore[call-arg]  # torch 2.7


def writes_torch_save(writer: Any) -> bool:
    """Whether ``writer`` writes records with ``torch.save`` (the only format before torch 2.8)."""
    if _SERIALIZATION_FORMAT is None:
        return True
    return bool(writer.serialization_format == _SERIALIZATION_FORMAT.TORCH_SAVE)


_LOAD_TAKES_NO_DIST = "no_dist" in inspect.signature(load).parameters  # torch >= 2.7


def dcp_load(
    state_dict: dict[str, Any], reader: StorageReader, planner: LoadPlanner, group: dist.ProcessGroup | None
) -> None:
    """DCP's ``load`` by the ranks of ``group``, or by this process alone (``group=None``) even inside a group."""
    if _LOAD_TAKES_NO_DIST:
        load(state_dict, storage_reader=reader, planner=planner, process_group=group, no_dist=group is None)
    elif group is None and dist.is_available() and dist.is_initialized():  # torch 2.6 would use the default group
        load_state_dict(state_dict, reader, no_dist=True, planner=planner)
    else:
        load(state_dict, storage_reader=reader, planner=planner, process_group=group)


# -- torch.distributed -----------------------------------------------------------------------------------------------
# PrefixStore, Store, TCPStore: c10d's stores (torch.distributed re-exports them without declaring it to type checkers).
get_default_store: Callable[[], Store] = _get_default_store
"""The c10d store of the default process group."""

# -- tensor subclasses -------------------------------------------------------------------------------------------------
# What a wrapper subclass sets as its __torch_function__ so that only __torch_dispatch__ sees its operations.
disabled_torch_function_impl: Any = torch._C._disabled_torch_function_impl
# What ``with torch.device(...)`` pushes: a mode that gives tensor factories a default device, and the factories it
# covers; stage 3 builds on meta with a subclass of it (Note [metrics stay off meta] in ``stage3/library_init.py``).
DeviceContext = _DeviceContext
device_constructors: Callable[[], set[Callable[..., Any]]] = _device_constructors

# A tensor subclass without storage of its own, whose ops run in its ``__torch_dispatch__`` (DTensor's mechanism;
# Note [gradients visible to hooks] in ``engine/sharded_gradient.py``), and the pytree map over an op's arguments.
tree_map: Callable[..., Any] = _tree_map


def make_wrapper_subclass(
    cls: type[Tensor], like: Tensor, shape: torch.Size | None = None, dtype: torch.dtype | None = None
) -> Tensor:
    """An instance of ``cls`` with ``like``'s shape, dtype and device (or the ``shape`` and ``dtype`` given) and no
    storage."""
    shape = like.shape if shape is None else shape
    return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype or like.dtype, device=like.device)


def dtensor_over(local: Tensor, mesh: Any, placements: Sequence[Any], shape: torch.Size) -> DTensor:
    """A DTensor of global ``shape`` (contiguous strides) over ``local`` as it is: ``DTensor.from_local`` runs an op on
    the local tensor (a view), which reads a lazy one (Note [checkpoint hooks see the model's values] in
    ``checkpoint/model_entries.py``)."""
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def local_tensor_of(tensor: DTensor) -> Tensor:
    """A DTensor's local tensor as it is (``to_local()`` runs an op on it: a view, which reads a lazy one)."""
    local: Tensor = tensor._local_tensor
    return local


def broadcast_coalesced(group: dist.ProcessGroup, tensors: Sequence[Tensor], bucket_bytes: int, src: int) -> None:
    """DDP's own coalesced broadcast of ``tensors`` from ``src``, in buckets of ``bucket_bytes``."""
    dist._broadcast_coalesced(group, list(tensors), bucket_bytes, src)  # type: ignore[attr-defined]


# apply_activation_checkpointing, checkpoint_wrapper, CheckpointWrapper: torch's activation checkpoint wrapper, which
# FSDP's strategies apply (torch keeps it in a private module).
CHECKPOINT_WRAPPER_PREFIX: str = _CHECKPOINT_PREFIX
"""The name segment (``"_checkpoint_wrapped_module."``) a checkpoint wrapper adds to the names of what it wraps."""


# -- autograd and storages -------------------------------------------------------------------------------------------
def current_autograd_node() -> Any:
    """The autograd node executing now on this thread (None outside a backward's node)."""
    return torch._C._current_autograd_node()


def current_graph_task_id() -> int:
    """The id of the graph task (backward) executing on this thread; -1 outside any."""
    return int(torch._C._current_graph_task_id())


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward's graph task finishes (what FSDP uses)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


SWAPS_STORAGE_MEMORY = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
"""Whether this torch can move the memory of one storage into another (``swap_storage_memory``)."""


def swap_storage_memory(storage: torch.UntypedStorage, other: torch.UntypedStorage) -> None:
    """Exchange the memory of two storages in place (views of each keep pointing at their own storage)."""
    storage._swap_data_ptr_(other)  # type: ignore[attr-defined]


def fused_adam_kernel(decoupled_weight_decay: bool) -> Callable[..., None]:
    """torch's fused multi-tensor Adam step (``_fused_adamw_``, or ``_fused_adam_`` with L2 weight decay)."""
    return torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_


def non_finite_check_and_unscale_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``GradScaler``'s fused unscale: multiply ``grads`` by ``inv_scale``, set ``found_inf`` if any is not finite."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


# -- torch.save's file format, written one tensor at a time (checkpoint/full_save.py) --------------------------------
rebuild_tensor = torch._utils._rebuild_tensor_v2
"""What torch.save pickles a tensor as (allowed by ``torch.load(weights_only=True)``): ``rebuild_tensor(storage,
offset, size, stride, requires_grad, backward_hooks)``, the storage a persistent id naming a record of the archive."""


def storage_type(dtype: torch.dtype) -> Any:
    """The storage class a torch.save file names for ``dtype`` in a storage's persistent id (``torch.FloatStorage``)."""
    typed = torch.storage.TypedStorage(dtype=dtype, device="meta", _internal=True)
    return getattr(torch, typed._pickle_storage_type())


def open_torch_save_archive(path: str, data_pkl: bytes) -> Any:
    """torch.save's zip writer (``torch._C.PyTorchFileWriter``) on ``path`` with the records torch.save writes before
    the storages: the pickled object and the format markers. The caller adds each storage as
    ``write_record(f"data/{key}", untyped_storage, nbytes)`` and ends with ``write_end_of_file()``."""
    writer = torch._C.PyTorchFileWriter(path)
    writer.write_record("data.pkl", data_pkl, len(data_pkl))
    writer.write_record(".format_version", b"1", 1)
    alignment = getattr(torch.serialization, "_get_storage_alignment", None)  # torch >= 2.7 records it
    if alignment is not None:
        value = str(alignment()).encode()
        writer.write_record(".storage_alignment", value, len(value))
    writer.write_record("byteorder", sys.byteorder.encode(), len(sys.byteorder))
    return writer


# -- Lightning -------------------------------------------------------------------------------------------------------
sync_module_states = _sync_module_states
"""Broadcast a module's parameters and buffers from rank 0 (what DDP does when it wraps a module)."""
convert_fp_tensor = _convert_fp_tensor
DtypeContextManager = _DtypeContextManager
MultiProcessingLauncher = _MultiProcessingLauncher
SubprocessScriptLauncher = _SubprocessScriptLauncher
MockOptimizer = _MockOptimizer
"""What Lightning puts in ``trainer.optimizers`` when ``configure_optimizers`` returns None (it trains without one)."""
distributed_is_initialized = _distributed_is_initialized
default_process_group_backend_for_device = _get_default_process_group_backend_for_device
init_dist_connection = _init_dist_connection
sync_ddp_if_available = _sync_ddp_if_available


# -- Lightning Fabric -------------------------------------------------------------------------------------------------
# The interfaces Fabric checks a strategy against (`no_backward_sync`, `init_module`'s sharded context), the protocol
# of objects with a state dict, and the strict-loading check its own strategies apply to `fabric.load`.
FabricBackwardSyncControl = _BackwardSyncControl
FabricSharded = _Sharded
FabricStateful = _Stateful
validate_keys_for_strict_loading = _validate_keys_for_strict_loading


def at_threading_shutdown(callback: Callable[[], None]) -> None:
    """Call ``callback`` as the process ends, before the interpreter stops daemon threads: Python's
    ``threading._register_atexit`` (what ``concurrent.futures`` uses), which runs at a script's normal end and at the
    end of a ``multiprocessing`` child, spawned or forked (where ``atexit`` does not run)."""
    threading._register_atexit(callback)  # type: ignore[attr-defined]


def fabric_run_command() -> Any:
    """The click command behind ``fabric run``. Imported when called: its ``--strategy`` choices are Fabric's
    registry at import time, which must hold ZeRO's names by then."""
    return importlib.import_module("lightning.fabric.cli")._run


def layer_sync(strategy: Any) -> Any:
    """The ``LayerSync`` plugin the Trainer gave a parallel strategy (``Trainer(sync_batchnorm=True)``), or None."""
    return getattr(strategy, "_layer_sync", None)


def route_checkpoint_model_state(trainer: Any, model_state: Callable[[], dict[str, Any]]) -> None:
    """Have the Trainer's checkpoint dump (``_CheckpointConnector.dump_checkpoint``, through its
    ``_get_lightning_module_state_dict``) take the model's state from ``model_state`` rather than from
    ``strategy.lightning_module_state_dict()``."""
    trainer._checkpoint_connector._get_lightning_module_state_dict = model_state


def batches_that_stepped(trainer: Any) -> int:
    """The step Lightning's loggers record this batch's metrics at (the count of batches that stepped before it)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


# -- planning: a training step on fake tensors (``lightning_zero/planning/``) ---------------------------------------
# FakeTensorMode: tensors with shapes, dtypes and devices and no memory; TorchDispatchMode: sees every op and the
# tensors it returns; ModTracker: module forward and backward boundaries (multi-grad hooks), as torch's MemTracker
# uses them; tree_flatten / tree_map_only: torch's pytree over a batch's nested structure.
# flop_registry: the FLOP formula of each op, by op packet, as ``FlopCounterMode`` counts them (not in its module's
# ``__all__``); ``engine/throughput.py`` counts a real step with it (Note [counting without touching the step]);
# HigherOrderOperator: an operator that runs other ops (``torch.cond``, ``flex_attention``), which such a count cannot
# see into.


def training_dataloader(trainer: Any) -> Any:
    """The training dataloader ``fit`` was given or will build (from the loaders, the data module or the model),
    before the fit loop sets it up; None when there is none."""
    source = trainer.fit_loop._data_source
    return source.dataloader() if source.is_defined() else None
