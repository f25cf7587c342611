"""The GPU check's section on ``state_dict_type="full"`` over NCCL (Note [full checkpoint on NCCL] in
``lightning_zero/checkpoint/full_save.py``): a stage-3 GPT trained a step, saved as one full file on NCCL, read back
with ``torch.load(weights_only=True)`` and compared with the gathered model and its Adam state
(``tests/test_full_save_backends.py``, whose ``gpu`` test runs the same on 1 and 2 GPUs). One GPU gives one NCCL rank:
the object collectives and the device staging run, the sends between ranks need two GPUs. The dry mode runs it on
two gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from gpu_check.common import Config, nccl_or_gloo, ranks


def _round_trip(config: Config) -> dict[str, Any]:
    from tests.test_full_save_backends import full_save_round_trip

    device = nccl_or_gloo(config)
    path = Path(config.out) / ".full_save_nccl.ckpt"
    try:
        return full_save_round_trip(device, str(path))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            path.unlink(missing_ok=True)


def full_save_nccl(config: Config) -> dict[str, Any]:
    world = 1 if config.device == "cuda" else 2  # one NCCL rank per GPU
    results = ranks(config, _round_trip, world)
    checks = []
    for rank, result in enumerate(results):
        if not result["keys"] or result["max_error"] != 0:
            checks.append(f"rank {rank}: the full file's weights differ from the model's ({result['max_error']})")
        if result["adam_entries"] != result["parameters"] or not result["finite"]:
            checks.append(f"rank {rank}: Adam state for {result['adam_entries']} of {result['parameters']} parameters")
        if config.device == "cuda" and not result["staged_on"].startswith("cuda"):
            checks.append(f"rank {rank}: staged on {result['staged_on']}, which NCCL cannot send")
    return {"result": {"world": world, "per_rank": results}, "failed_checks": checks}
