"""``LazyEntry``: a stage-3 parameter's values as a save's checkpoint hooks see them, read from the shards only when
an operation uses them (``LazyValues``, a bucket at a time); Note [checkpoint hooks see the model's values] in
``model_entries.py``."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.module_state import ModuleState
from lightning_zero.compat import disabled_torch_function_impl, make_wrapper_subclass, tree_map

__all__ = ["HINT_REPLACE", "LazyEntry", "LazyValues"]

HINT_REPLACE = (
    "HINT: replace the entry instead of writing into it, e.g. "
    "`checkpoint['state_dict'][key] = checkpoint['state_dict'][key] * 0.5`."
)


class LazyEntry(Tensor):
    """A stage-3 parameter's values as a save's hooks see them (Note [checkpoint hooks see the model's values]): its
    full shape (``state_dict_type="full"``) or this rank's ``Shard(0)`` rows (a DTensor's local tensor), with the
    values' dtype and no memory; an operation reads them (``LazyValues``) and runs on them."""

    _lazy_values: LazyValues
    _lazy_param: Tensor
    _lazy_key: str

    @staticmethod
    def __new__(
        cls: type[LazyEntry],
        like: Tensor,
        shape: torch.Size,
        dtype: torch.dtype,
        values: LazyValues,
        param: Tensor,
        key: str,
    ) -> LazyEntry:
        made = make_wrapper_subclass(cls, like, shape, dtype)
        assert isinstance(made, LazyEntry)
        made._lazy_values, made._lazy_param, made._lazy_key = values, param, key
        return made

    def __repr__(self) -> str:  # type: ignore[override]
        # No read: a repr on one rank (a debugger, a log line) must not start a collective.
        return f"LazyEntry({self._lazy_key!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    __torch_function__ = disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):  # `.detach()`, `.data`: not read
            return args[0]
        for i, argument in enumerate(func._schema.arguments):
            target = args[i] if i < len(args) else kwargs.get(argument.name)
            targets = target if isinstance(target, list | tuple) else [target]
            written = [t._lazy_key for t in targets if isinstance(t, LazyEntry)]
            if written and argument.alias_info is not None and argument.alias_info.is_write:
                raise RuntimeError(
                    f"{func} writes into checkpoint['state_dict'][{written[0]!r}] in place: at stage 3 the entry shows "
                    "the model's values read from the shards, and the save writes the shards of an entry left as it "
                    f"was handed out (Note [checkpoint hooks see the model's values]). {HINT_REPLACE}"
                )
        read: Callable[[Any], Any] = lambda x: x.read() if isinstance(x, LazyEntry) else x  # noqa: E731
        return func(*tree_map(read, args), **tree_map(read, kwargs))

    def read(self) -> Tensor:
        """The values (collective when its bucket is not read yet, or no longer kept)."""
        return self._lazy_values.read(self._lazy_param)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.read().__reduce_ex__(protocol)


class LazyValues:
    """The values the lazy entries of one save read, gathered a bucket at a time (``ModuleState.read_bucket``):
    every ``Shard(0)`` rows read are kept (about 1/N of the model at most), full values one bucket at a time; and
    whether the hooks wrote into any of them (through a view, which the entry's own operations cannot see)."""

    def __init__(self, module_state: ModuleState, rows: bool) -> None:
        self.module_state = module_state
        self.rows = rows
        self.keys: dict[int, str] = {}
        """By ``id`` of a parameter: its first key."""
        self._kept: dict[int, Tensor] = {}
        self._read: list[tuple[weakref.ref[Tensor], int, int]] = []  # (tensor read, its version then, a parameter)

    def read(self, param: Tensor) -> Tensor:
        if id(param) not in self._kept:
            if not self.rows:
                self._kept.clear()  # one bucket's full values at a time
            flat, values = self.module_state.read_bucket(param, self.rows)
            self._kept.update(values)
            # A view keeps its base alive: while anything read can still be written into, its base is tracked.
            read = list(values.items()) if self.rows else [(id(param), flat)]
            self._read += [(weakref.ref(t), t._version, p) for p, t in read]
        return self._kept[id(param)]

    def written(self) -> str | None:
        """The key of an entry whose values were written into since read, if any."""
        for ref, version, param in self._read:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                return self.keys.get(param, "?")
        return None

    def release(self) -> None:
        self._kept.clear()
        self._read.clear()
