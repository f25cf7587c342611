"""``python -m lightning_zero <command>``: tools that run without a training job.

python -m lightning_zero consolidate CKPT_DIR OUT_FILE   # a sharded checkpoint -> one plain checkpoint
python -m lightning_zero estimate --params 7.5e9 --gpus 64  # model-state memory per rank, per stage
python -m lightning_zero fabric-run --strategy zero3 --devices 2 train.py  # Fabric's `fabric run`, with ZeRO
"""

from __future__ import annotations

import importlib
import sys

# Each command lives in its own module, imported only when used so that one command's dependencies never slow or
# break another.
_COMMANDS = {
    "consolidate": "lightning_zero.cli.consolidate",
    "estimate": "lightning_zero.cli.estimate",
    "fabric-run": "lightning_zero.cli.fabric_run",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nUnknown command {argv[0]!r}. Expected one of: {', '.join(_COMMANDS)}.", file=sys.stderr)
            return 2
        return 0 if argv else 2
    module = importlib.import_module(_COMMANDS[argv[0]])
    result: int = module.main(argv[1:])
    return result


if __name__ == "__main__":
    sys.exit(main())
