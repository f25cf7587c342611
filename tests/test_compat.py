"""``lightning_zero/compat.py``: every private torch and Lightning API the package relies on resolves on the installed
versions, and nothing outside ``compat.py`` imports from a private module or calls a private function of theirs."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_zero import compat

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_zero"

# Each private symbol we rely on, by the name it has in torch or Lightning, and the compat name it is used through.
PRIVATE = {
    "torch.distributed.checkpoint._fsspec_filesystem.FsspecReader": "FsspecReader",
    "torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter": "FsspecWriter",
    "torch.distributed.checkpoint.filesystem._StorageInfo": "StorageInfo",
    "torch.distributed.checkpoint.filesystem._write_item": "write_dcp_item",
    "torch.distributed.checkpoint.filesystem.SerializationFormat (torch >= 2.8)": "writes_torch_save",
    "torch.distributed.distributed_c10d._get_default_store": "get_default_store",
    "torch._C._disabled_torch_function_impl": "disabled_torch_function_impl",
    "torch._C._distributed_c10d.PrefixStore": "PrefixStore",
    "torch._C._distributed_c10d.Store": "Store",
    "torch._C._distributed_c10d.TCPStore": "TCPStore",
    "torch.distributed._broadcast_coalesced": "broadcast_coalesced",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX": "CHECKPOINT_WRAPPER_PREFIX",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper": "CheckpointWrapper",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing": (
        "apply_activation_checkpointing"
    ),
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper": "checkpoint_wrapper",
    "torch._C._current_autograd_node": "current_autograd_node",
    "torch._C._current_graph_task_id": "current_graph_task_id",
    "torch.autograd.Variable._execution_engine.queue_callback": "queue_autograd_callback",
    "torch.UntypedStorage._swap_data_ptr_ (newer than 2.7)": "swap_storage_memory",
    "torch._amp_foreach_non_finite_check_and_unscale_": "non_finite_check_and_unscale_",
    "torch._fused_adamw_, torch._fused_adam_": "fused_adam_kernel",
    "torch._utils._rebuild_tensor_v2": "rebuild_tensor",
    "torch.storage.TypedStorage._pickle_storage_type": "storage_type",
    "torch._C.PyTorchFileWriter, torch.serialization._get_storage_alignment": "open_torch_save_archive",
    "lightning.pytorch.overrides.distributed._sync_module_states": "sync_module_states",
    "lightning.fabric.plugins.precision.utils._convert_fp_tensor": "convert_fp_tensor",
    "lightning.fabric.plugins.precision.utils._DtypeContextManager": "DtypeContextManager",
    "lightning.pytorch.strategies.launchers._MultiProcessingLauncher": "MultiProcessingLauncher",
    "lightning.pytorch.strategies.launchers._SubprocessScriptLauncher": "SubprocessScriptLauncher",
    "lightning.pytorch.core.optimizer._MockOptimizer": "MockOptimizer",
    "torch.utils._device.DeviceContext": "DeviceContext",
    "torch.utils._device._device_constructors": "device_constructors",
    "torch.utils._pytree.tree_map": "tree_map",
    "torch.Tensor._make_wrapper_subclass": "make_wrapper_subclass",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec, TensorMeta": "dtensor_over",
    "torch.distributed.tensor.DTensor._local_tensor": "local_tensor_of",
    "lightning.fabric.utilities.distributed._distributed_is_initialized": "distributed_is_initialized",
    "lightning.fabric.utilities.distributed._get_default_process_group_backend_for_device": (
        "default_process_group_backend_for_device"
    ),
    "lightning.fabric.utilities.distributed._init_dist_connection": "init_dist_connection",
    "lightning.fabric.utilities.distributed._sync_ddp_if_available": "sync_ddp_if_available",
    "lightning.pytorch.strategies.ParallelStrategy._layer_sync": "layer_sync",
    "lightning.pytorch.loops._TrainingEpochLoop._batches_that_stepped": "batches_that_stepped",
    "torch._subclasses.fake_tensor.FakeTensorMode": "FakeTensorMode",
    "torch.distributed._tools.mod_tracker.ModTracker": "ModTracker",
    "torch.utils._python_dispatch.TorchDispatchMode": "TorchDispatchMode",
    "torch.utils._pytree.tree_flatten": "tree_flatten",
    "torch.utils._pytree.tree_map_only": "tree_map_only",
    "torch.utils.flop_counter.flop_registry (not in the module's __all__)": "flop_registry",
    "torch._ops.HigherOrderOperator": "HigherOrderOperator",
    "lightning.pytorch.loops.FitLoop._data_source": "training_dataloader",
    "threading._register_atexit (Python's own)": "at_threading_shutdown",
    "lightning.pytorch.trainer.connectors._CheckpointConnector._get_lightning_module_state_dict": (
        "route_checkpoint_model_state"
    ),
}


@pytest.mark.parametrize("private", sorted(PRIVATE))
def test_each_private_symbol_resolves_through_compat(private):
    name = PRIVATE[private]
    assert name in compat.__all__, name
    assert getattr(compat, name) is not None, private


def test_the_version_dependent_symbols_resolve_on_this_torch():
    from torch.distributed.checkpoint import filesystem

    assert hasattr(filesystem._FileSystemWriter, "_write_data") == compat.DCP_WRITER_HAS_WRITE_DATA
    assert hasattr(torch.UntypedStorage, "_swap_data_ptr_") == compat.SWAPS_STORAGE_MEMORY
    parameters = list(inspect.signature(filesystem._write_item).parameters)
    assert parameters[0] in ("stream", "transforms"), parameters  # the signatures write_dcp_item knows
    assert compat.current_graph_task_id() == -1
    assert compat.current_autograd_node() is None
    x = torch.ones(2, requires_grad=True)
    seen: list[object] = []

    def record(grad: torch.Tensor) -> None:
        seen.append(compat.current_graph_task_id())
        compat.queue_autograd_callback(lambda: seen.append("end"))

    x.register_hook(record)
    (x * 2).sum().backward()
    assert seen[0] != -1
    assert seen[-1] == "end"
    grads, found, inv = [torch.tensor([2.0, float("inf")])], torch.zeros(1), torch.tensor(0.5)
    compat.non_finite_check_and_unscale_(grads, found, inv)
    assert found.item() == 1.0


def test_the_extension_points_of_lightning_classes_we_override_exist():
    """Not routed through compat (a subclass overrides or sets them), but relied on: they must still be there."""
    from lightning.pytorch.strategies import ParallelStrategy, Strategy

    assert callable(Strategy._configure_launcher)
    assert callable(compat.MultiProcessingLauncher._collect_rank_zero_results)  # FullWeightsLauncher's override
    assert "_launcher" in inspect.getsource(Strategy.__init__)
    assert "_precision_plugin" in inspect.getsource(Strategy.__init__)
    assert "_layer_sync" in inspect.getsource(ParallelStrategy.__init__)
    assert callable(Precision._clip_gradients)
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    # route_checkpoint_model_state replaces the method dump_checkpoint takes the model's state from
    assert "self._get_lightning_module_state_dict()" in inspect.getsource(_CheckpointConnector.dump_checkpoint)
    # Attributes of torch's objects read or set where the object is (optimizer hook registries, storages' ids,
    # tensors' version counters, the RNN's flat weights, MultiheadAttention's initializer).
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    for registry in (
        "_optimizer_step_pre_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
    ):
        assert isinstance(getattr(optimizer, registry), dict), registry
    assert isinstance(torch.ones(1).untyped_storage()._cdata, int)
    assert isinstance(torch.ones(1)._version, int)
    lstm = nn.LSTM(2, 2)
    assert hasattr(lstm, "_flat_weight_refs")
    assert callable(lstm._init_flat_weights)
    assert callable(nn.MultiheadAttention(4, 2)._reset_parameters)


_PRIVATE_MODULE_ROOTS = ("torch", "lightning", "lightning_fabric", "pytorch_lightning")


def _private_uses(path: Path) -> list[str]:
    """Imports of a private name or module of torch/Lightning, and calls of ``torch._x`` / ``dist._x``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _PRIVATE_MODULE_ROOTS:
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names):
                found.append(f"{path.name}:{node.lineno} from {node.module} import {', '.join(names)}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if owner in ("torch", "dist", "torch._C", "torch.distributed") and not node.attr.startswith("_foreach_"):
                found.append(f"{path.name}:{node.lineno} {owner}.{node.attr}")
            if owner.endswith("Variable") or node.attr in ("_swap_data_ptr_", "_batches_that_stepped", "_layer_sync"):
                found.append(f"{path.name}:{node.lineno} {owner}.{node.attr}")
    return found


def test_nothing_but_compat_touches_private_torch_or_lightning_apis():
    found = [use for path in sorted(PACKAGE.rglob("*.py")) if path.name != "compat.py" for use in _private_uses(path)]
    assert not found, f"private torch/Lightning APIs used outside lightning_zero/compat.py: {found}"
