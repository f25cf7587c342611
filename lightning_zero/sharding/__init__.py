"""Stages 1 and 2, and the optimizer every stage shares: flat buckets, gradient reduction, the sharded step.

- ``flat_bucket``: ``FlatBucket``, parameters flattened into one padded buffer split into N equal shards.
- ``gradient_reducer``: the reduction protocol (hooks, ordered launch, end-of-backward flush); the stage-1
  (``full_grad_reducer``) and stage-2 (``sharded_grad_reducer``) storages plug into it.
- ``gradient_arrivals``: when a bucket's gradients are final in a backward (hook calls counted per parameter).
- ``launch_order``: ``LaunchOrder``, the order a reducer launches its buckets in (Note [bucket order]).
- ``gradient_owners``: which optimizer steps which elements of a reducer's gradient shards shared by several.
- ``param_groups``: the user's param groups over this rank's shard (segments, masters, views, the checks).
- ``param_edits``: ``ParamEdits``, parameter shards edited between steps reaching their masters: by a masked copy
  where the masters are on the device, found by digests on the device where they are not (Note [edits reach the
  masters]).
- ``sharded_optimizer``: ``ZeroOptimizer``, the user's optimizer stepping only this rank's shard; with
  ``gradient_clipping`` (by norm and value, over shards), ``gradient_presence`` (which parameters got a gradient on
  some rank: DDP's unused-parameter semantics), ``optimizer_hooks`` (torch's optimizer hooks on the wrapper) and
  ``step_chunks`` (the step bucket by bucket, each bucket's all-gather overlapping the next).
- ``trainable_parameters``: ``TrainableParameters``, which parameters an optimizer trains, decided once at setup
  (a parameter (un)frozen later is refused).
- ``sharded_parameters``: ``ShardedParameters``, the protocol through which the optimizer sees a stage-3 model.
- ``activation_checkpointing``: activation checkpointing by policy (torch's checkpoint wrapper on the layers
  selected, before stage 3 forms units), and parameter names as ``state_dict()`` gives them under the wrappers.
- ``loss_scaler``: the cross-rank dynamic loss scaler of fp16 training.
- ``state_tiers``: ``StateTiers``, the hooks through which memory tiers (``lightning_zero.offload``) hold masters,
  optimizer state and gradient shards between steps (Note [tiered step]).

Stage 3 builds on this package (its units are flat buckets reduced by the stage-2 reducer) but this package knows
nothing of stage 3: ``ZeroOptimizer`` takes any object with the ``ShardedParameters`` protocol.

May import: lightning_zero.config, lightning_zero.comm
"""
