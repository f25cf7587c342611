"""A sharded checkpoint directory -> one plain Lightning checkpoint file, on one CPU process without a process group.

    python -m lightning_zero consolidate CKPT_DIR OUT_FILE [--weights live|ema]

Either path may be an fsspec URL (``s3://bucket/run/last.ckpt``, ``gs://...``, ``memory://...``).

The output holds the full fp32 ``state_dict`` under the LightningModule's own key names (tied parameters share one
tensor, as ``state_dict()`` has them) plus Lightning's fields (epoch, global step, loops, hyper-parameters, ...), so
``MyModule.load_from_checkpoint(OUT_FILE)`` and ``nn.Module.load_state_dict(torch.load(OUT_FILE)["state_dict"])``
both work. Optimizer and LR-scheduler state are left out, as in Lightning's ``save_weights_only`` checkpoints.
``--weights ema`` exports the moving average ``ShardedEMA`` kept (saved as optimizer state: Note [EMA as optimizer
state] in ``trainer/ema.py``) in place of the trained weights, for every parameter that has one; frozen parameters
and buffers, which are not averaged, are exported as they are.

Tensors are read one at a time, each from every saved chunk of it (fp32 masters where the run kept them), so peak
memory is the output state dict plus one tensor: no optimizer state is ever read.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from lightning_zero.checkpoint.files import CheckpointError, SafeReader
from lightning_zero.checkpoint.format import (
    FlatChunk,
    SafeLoadPlanner,
    Toc,
    info_dtype,
    model_key,
    open_committed,
)
from lightning_zero.checkpoint.local_commit import partial_sibling, recover_interrupted_commit, write_synced
from lightning_zero.checkpoint.storage import Location, locate, put_atomically, serialized
from lightning_zero.compat import dcp_load

# Lightning state that only makes sense next to the optimizer tensors this file leaves out, and WeightAveraging's
# averaged-model counters, which belong with the averaged copy that is either exported or left out.
_DROPPED = ("optimizer_states", "lr_schedulers", "averaging_state")
# The optimizer state entry ShardedEMA keeps its average in (lightning_zero.trainer.ema.EMA_KEY; cli may not import
# lightning, so the name is repeated here and a test checks they agree).
EMA_STATE = "ema"


def consolidate_checkpoint(
    ckpt_dir: str | os.PathLike[str], out_file: str | os.PathLike[str], weights: Literal["live", "ema"] = "live"
) -> Path | str:
    """Write the checkpoint directory ``ckpt_dir`` as the single file ``out_file`` (replaced atomically); either may be
    a local path or an fsspec URL. Returns the file written: a ``Path``, or the URL.

    ``weights="ema"`` writes ``ShardedEMA``'s average instead of the trained weights."""
    if weights not in ("live", "ema"):
        raise ValueError(f"Invalid weights: {weights!r}. Expected 'live' (the trained weights) or 'ema'.")
    directory, out = locate(ckpt_dir), locate(out_file)
    if not directory.remote:
        recover_interrupted_commit(directory.local)  # Note [atomic commit]
    directory.forget_listings()
    state, toc, data, metadata = open_committed(directory)
    reader = SafeReader(data, metadata, toc["files"])
    averages = _ema_storage(toc, directory) if weights == "ema" else {}
    full: dict[str, Tensor] = {}
    by_storage: dict[str, Tensor] = {}
    for key, storage in toc["state_dict"].items():
        if storage not in by_storage:
            # The average, or the fp32 master when the parameters were low precision, or the parameter itself.
            source = averages.get(storage) or toc["masters"].get(storage, storage)
            shape = torch.Size(toc["tensors"][storage]["shape"])
            flat = torch.empty(shape.numel(), dtype=info_dtype(toc["tensors"][source]))
            # Flat sources are read as one chunk spanning all the saved ones; a WeightAveraging copy is stored whole.
            request = FlatChunk(flat, 0, shape) if toc["tensors"][source]["flat"] else flat.view(shape)
            with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the point
                warnings.simplefilter("ignore", UserWarning)
                dcp_load({source: request}, reader, SafeLoadPlanner(), None)  # this process alone, even in a group
            tensor = flat.view(shape)
            by_storage[storage] = tensor.float() if tensor.is_floating_point() else tensor
        full[key] = by_storage[storage]
    consolidated = {k: v for k, v in state.items() if k not in _DROPPED}
    consolidated["state_dict"] = full
    if out.remote:  # one object write: the old file or the new one (Note [commit on an object store])
        put_atomically(serialized(lambda stream: torch.save(consolidated, stream)), out)
        return out.url
    out.local.parent.mkdir(parents=True, exist_ok=True)
    staged = partial_sibling(out.local)
    try:
        write_synced(consolidated, staged)
        os.replace(staged, out.local)
    finally:
        staged.unlink(missing_ok=True)
    return out.local


def _ema_storage(toc: Toc, directory: Location) -> dict[str, str]:
    """Model storage key -> storage key of its saved average, for every parameter (or, from Lightning's
    ``WeightAveraging``, every entry) with one."""
    averages = {
        toc["state_dict"].get(fqn, model_key(fqn)): entries[EMA_STATE]
        for names in toc["optimizers"]
        for fqn, entries in names.items()
        if EMA_STATE in entries
    }
    # Lightning's WeightAveraging callbacks at stages 1 and 2 (Note [Lightning's WeightAveraging]).
    named = toc["state_dict"]
    averages.update({named[key]: storage for key, storage in toc.get("averaged", {}).items() if key in named})
    if not averages:
        raise CheckpointError(
            f"{directory} holds no moving average of the weights. HINT: train with the `lightning_zero.ShardedEMA` "
            "callback (or Lightning's `EMAWeightAveraging` at stages 1 and 2; the average is saved after its first "
            "update), or export the trained weights with "
            "`--weights live`."
        )
    return averages


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_zero consolidate",
        description="Write a sharded lightning_zero checkpoint directory as one plain Lightning checkpoint file.",
    )
    parser.add_argument("ckpt_dir", help="checkpoint directory written by ZeroStrategy")
    parser.add_argument("out_file", help="the single .ckpt file to write")
    parser.add_argument(
        "--weights",
        choices=("live", "ema"),
        default="live",
        help="live: the trained weights (default); ema: the moving average kept by the ShardedEMA callback",
    )
    args = parser.parse_args(argv)
    try:
        out = consolidate_checkpoint(args.ckpt_dir, args.out_file, args.weights)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({locate(out).size() / 2**20:.1f} MiB)")
    return 0
