"""Stage 3: parameters sharded too, gathered per unit around its forward and backward.

- ``wrap_policy``: which modules become gather units, and which unit owns each (possibly tied) parameter.
- ``sharded_unit``: ``ShardedUnit``, one unit's buckets and their ``SHARDED / GATHERING / GATHERED`` lifecycle.
- ``parameter_gatherer``: ``ParameterGatherer``, the module and autograd hooks that gather, free and prefetch units.
- ``autograd_hooks``: the tensors a unit takes and returns, and knowing when a unit's backward is over.
- ``divergence``: the index exchanges that keep ranks' gathers paired, and ``RankDivergenceError``.
- ``gathered_buffers``: on the CPU, a released unit's memory taken over by the next gather of its size.
- ``unit_backward``: ``UnitBackward``, the gatherer's backward: gather at a unit's first output gradient, free after.
- ``unit_order``: ``UnitOrder``, the order a pass uses the units in, for prefetching.
- ``outside_step``: ``OutsideStep``, full parameters gathered outside forward and backward, and refreshed after.
- ``one_rank_calls``: ``OneRankCalls``, calls outside a step met in the store; a lone caller served by the others.
- ``sharded_init``: meta-device models materialized, initialized and sharded one unit at a time.
- ``library_init``: how Hugging Face models, peft adapters and torch's composite modules initialize, on meta.
- ``secondary_shard``: how a unit's buckets are all-gathered: plainly, or ZeRO++'s way (qwZ, hpZ).
- ``zeropp``: ZeRO++ on a sharded model: topology, groups, and the communicators of each switch.

Stage 3 = stage 2 + parameter gathering: the units' buckets are reduced by ``sharding``'s stage-2 reducer and
stepped by the same ``ZeroOptimizer``.

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding
"""
