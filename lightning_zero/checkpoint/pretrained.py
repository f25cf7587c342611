"""Pretrained weights as a source for ZeRO's load plan: a ``.safetensors`` file, a Hugging Face checkpoint directory
(``model.safetensors``, or shards listed in ``model.safetensors.index.json``), or a ``torch.save`` file.

Safetensors files are opened with ``safe_open`` (memory-mapped): a rank reads, one parameter at a time, only the rows
that hold the flat range it owns (``get_slice``), so loading pages in about this rank's shard of the file, never the
whole model. Names are matched as users hold models: the file's keys may lack the prefix under which the model sits
in the LightningModule (``self.model = AutoModelForCausalLM...`` holds ``model.`` + the file's keys), found by
``match_keys``, and a peft model's wrapped layers (``q_proj.base_layer.weight``) take the base model's
``q_proj.weight``. A tied weight that ``save_pretrained`` stored once (``lm_head.weight`` tied to the embedding) is
loaded through the name it was stored under.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.files import CheckpointError, CheckpointNotFoundError, load_lightning_state
from lightning_zero.checkpoint.format import Toc, empty_toc, model_key, tensor_info
from lightning_zero.checkpoint.full import FlatSource
from lightning_zero.checkpoint.storage import Location

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_PEFT_WRAPPED = ".base_layer."
"""What peft inserts into the names of the layers it wraps (``q_proj.weight`` -> ``q_proj.base_layer.weight``)."""


class SafetensorsSlice:
    """One tensor of a safetensors file, read by flat ranges: only the rows holding the range are read."""

    def __init__(self, name: str, piece: Any, origin: Location) -> None:
        dtype = _DTYPES.get(piece.get_dtype())
        if dtype is None:
            raise CheckpointError(
                f"Tensor {name!r} of {origin} has dtype {piece.get_dtype()}, which load_full_state_dict does not "
                f"read. HINT: save the weights in one of {sorted(_DTYPES)}."
            )
        self.piece = piece
        self.shape = torch.Size(piece.get_shape())
        self.dtype = dtype

    def __getitem__(self, index: slice) -> Tensor:
        start, stop, _ = index.indices(self.shape.numel())
        if not self.shape:
            whole: Tensor = self.piece[...]
            return whole.reshape(-1)[start:stop]
        row = math.prod(self.shape[1:])  # elements per first-dimension index
        if row == 0 or stop <= start:
            return torch.empty(0, dtype=self.dtype)
        first, last = start // row, -(-stop // row)
        rows: Tensor = self.piece[first:last].reshape(-1)  # (last - first) * row elements, read from the file
        return rows[start - first * row : stop - first * row]


def is_pretrained_source(location: Location) -> bool:
    """Whether ``location`` is a safetensors file or a Hugging Face checkpoint directory (local)."""
    if location.remote:
        return False
    path = location.local
    if path.is_dir():
        return (path / SAFETENSORS_INDEX).is_file() or (path / SAFETENSORS_FILE).is_file()
    return path.suffix == ".safetensors"


def open_pretrained(origin: Location, files: contextlib.ExitStack) -> dict[str, Tensor | FlatSource]:
    """The tensors of a pretrained source by the file's key names, opened lazily (safetensors, kept open in
    ``files``) or memory-mapped (``torch.save`` files, whose Lightning ``state_dict`` is taken if there is one)."""
    if not is_pretrained_source(origin):
        if not origin.remote and origin.local.is_dir():
            raise CheckpointError(
                f"{origin} is a directory without {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}. HINT: pass a Hugging "
                "Face checkpoint directory written by `save_pretrained(...)` (safetensors, the default), a "
                ".safetensors file, or a file written by `torch.save(model.state_dict(), path)`."
            )
        state = load_lightning_state(origin, mmap=True)
        nested = state.get("state_dict")
        return dict(nested if isinstance(nested, Mapping) else state)
    from safetensors import safe_open  # a dependency of transformers; needed only for safetensors sources

    path = origin.local
    if not path.exists():
        raise CheckpointNotFoundError(f"Pretrained weights {origin} do not exist. HINT: check the path.")
    if path.is_dir() and (path / SAFETENSORS_INDEX).is_file():
        weight_map = _weight_map(origin / SAFETENSORS_INDEX)
        names = sorted(set(weight_map.values()))
    else:
        weight_map, names = None, [SAFETENSORS_FILE] if path.is_dir() else [path.name]
        path = path if path.is_dir() else path.parent
    sources: dict[str, Tensor | FlatSource] = {}
    for name in names:
        try:
            opened = files.enter_context(safe_open(str(path / name), framework="pt"))
        except Exception as error:
            raise CheckpointError(
                f"Could not open {origin / name if origin.local.is_dir() else origin}: {error}. HINT: the file is "
                "missing or not a safetensors file; re-download the checkpoint."
            ) from error
        for key in opened.keys():  # noqa: SIM118  (safe_open is no mapping)
            if weight_map is None or weight_map.get(key) == name:
                sources[key] = SafetensorsSlice(key, opened.get_slice(key), origin)
    missing = sorted(set(weight_map or ()) - set(sources))
    if missing:
        raise CheckpointError(
            f"{origin / SAFETENSORS_INDEX} lists {len(missing)} tensor(s) its files do not hold: {missing[:5]}. "
            "HINT: the download is incomplete; fetch every shard file again."
        )
    return sources


def _weight_map(index: Location) -> dict[str, str]:
    try:
        with index.open("rb") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"Could not read {index}: {error!r}. HINT: it must be the index `save_pretrained` writes, with a "
            "'weight_map' of tensor names to shard files."
        ) from error
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and v == v.rsplit("/", 1)[-1] and v.endswith(".safetensors") for v in weight_map.values()
    ):
        raise CheckpointError(f"{index} has an invalid 'weight_map'. HINT: re-download the checkpoint.")
    return weight_map


def match_keys(
    module_state: Mapping[str, Tensor], file_keys: Collection[str], prefix: str | None, origin: Location
) -> tuple[str, dict[str, str]]:
    """The prefix and {file key: module state-dict key} for every file key that names an entry of the module.

    ``prefix`` is prepended to the file's keys; None finds it: the one prefix (possibly empty) under which every key
    of the file names an entry of the module, if there is exactly one. A peft-wrapped layer's entries are also named
    as the base model's (without ``.base_layer``)."""
    lookup = {key: key for key in module_state}
    for key in module_state:
        plain = key.replace(_PEFT_WRAPPED, ".")
        lookup.setdefault(plain, key)
    if prefix is None:
        prefix = _find_prefix(lookup, file_keys, origin)
    return prefix, {key: lookup[prefix + key] for key in file_keys if prefix + key in lookup}


def _find_prefix(lookup: Mapping[str, str], file_keys: Collection[str], origin: Location) -> str:
    probes = sorted(file_keys)[:8]
    candidates = {""}
    for name in lookup:
        for key in probes:
            if name.endswith("." + key):
                candidates.add(name[: -len(key)])
    counts = {p: sum(p + key in lookup for key in file_keys) for p in candidates}
    best = max(counts.values(), default=0)
    complete = sorted(p for p, n in counts.items() if n == len(file_keys))
    if "" in complete:  # the file names the module's own entries
        return ""
    if len(complete) > 1:
        raise CheckpointError(
            f"The keys of {origin} name the entries of several submodules, under the prefixes {complete}. "
            "HINT: pass `prefix=` to say which one the weights are for."
        )
    if complete:
        return complete[0]
    return min((p for p, n in counts.items() if n == best), key=len)  # the best partial match; checked by the caller


def pretrained_sources(
    module_state: Mapping[str, Tensor],
    tensors: Mapping[str, Tensor | FlatSource],
    prefix: str | None,
    origin: Location,
    *,
    strict: bool,
    adapters: Sequence[str] = (),
) -> tuple[dict[str, Tensor | FlatSource], Toc]:
    """Sources by storage key and a table of contents naming the module's entries, for ``LoadPlan``.

    With ``strict``, every entry of the module under the resolved prefix (tied aliases of a loaded entry excepted)
    must be in the file, and every tensor of the file must name one; the error lists both. Entries under the
    ``adapters`` prefixes (peft's adapter layers, which a base model's file does not hold) may be missing."""
    prefix, names = match_keys(module_state, tensors, prefix, origin)
    if strict:
        _check_matched(module_state, tensors, names, prefix, origin, tuple(adapters))
    sources: dict[str, Tensor | FlatSource] = {}
    toc = empty_toc()
    for key, name in names.items():
        value = tensors[key]
        if not isinstance(value, Tensor | SafetensorsSlice):
            raise CheckpointError(
                f"State dict entry {key!r} of {origin} is a {type(value).__name__}, not a tensor. HINT: pass the "
                "model's state_dict (parameter and buffer names mapped to tensors)."
            )
        storage = model_key(name)
        sources[storage] = value.reshape(-1) if isinstance(value, Tensor) else value
        toc["state_dict"][name] = storage
        toc["tensors"][storage] = tensor_info(value.shape, value.dtype, flat=True)
    return sources, toc


def _check_matched(
    module_state: Mapping[str, Tensor],
    tensors: Mapping[str, Any],
    names: Mapping[str, str],
    prefix: str,
    origin: Location,
    adapters: tuple[str, ...],
) -> None:
    unexpected = sorted(set(tensors) - set(names))
    loaded = {id(module_state[name]) for name in names.values()}
    missing = sorted(
        k
        for k, v in module_state.items()
        if k.startswith(prefix) and k not in names.values() and id(v) not in loaded and not k.startswith(adapters)
    )
    if missing or unexpected:
        raise CheckpointError(
            f"{origin} does not match the model: {len(missing)} of its entries missing from the file {missing[:5]}, "
            f"{len(unexpected)} unexpected key(s) in the file {unexpected[:5]}; the file's keys were read under the "
            f"prefix {prefix!r}. HINT: pass `prefix=` naming the submodule the weights are for (e.g. 'model.' for "
            "`self.model = AutoModelForCausalLM...`), or `strict=False` to load only the matching keys (adapters "
            "that the file does not hold keep their initialization)."
        )
