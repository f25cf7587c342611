"""The engine as a front door uses it: what the Trainer's strategy (``lightning_zero.trainer``) and Fabric's
(``lightning_zero.fabric``) both do to a model and its optimizers, written once, below both.

- ``model_sharding``: stage 3's sharding of a model (and the takeover of one an earlier strategy sharded), the
  optimizers wrapped as ``ZeroOptimizer``s, rank 0's buffers broadcast, a stage-3 model's own ``state_dict`` made
  true, the one-rank-call wiring.
- ``tier_setup``: a rank's memory tiers (``lightning_zero.offload``) built, with the directory and space checks.
- ``precision``: ``ZeroPrecision``, ZeRO's mixed precision (low-precision parameters, fp32 masters).
- ``grad_norm``: ``grad_norm`` from the reduced shards; the partial gradients hidden, the reduced ones shown.
- ``memory``: per-rank model-state bytes, counted and as the ZeRO paper's formula.
- ``throughput``: samples, tokens and FLOPs per second, MFU.
- ``presets``: the strategy names both front doors register (``"zero1"`` ... and the memory-tier presets).

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding, lightning_zero.stage3,
lightning_zero.offload, lightning_zero.checkpoint, lightning_zero.planning
"""
