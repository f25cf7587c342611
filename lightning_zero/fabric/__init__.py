"""The Lightning Fabric front door: ZeRO in a Fabric loop, over the same engine and checkpoints as the Trainer's.

- ``strategy``: ``ZeroFabricStrategy`` (setup, sharded initialization, backward, accumulation, clipping, collectives,
  presets in Fabric's registry).
- ``models``: the set-up models, each with its units and optimizers (several per Fabric).
- ``zero_grad``: ``model.zero_grad()`` on a set-up model reaches the gradients ZeRO holds for it.
- ``visible_gradients``: ``.grad`` between ``fabric.backward`` and the step, the averaged gradient read from the shards.
- ``precision``: ``ZeroFabricPrecision``, ``ZeroPrecision`` under Fabric's backward and step protocol.
- ``module``: ``ZeroForwardModule``, what ``setup_module`` returns, so that Fabric routes marked methods through the
  model's call; the guard against saving stage-3 placeholders.
- ``backward_sync``: ``fabric.no_backward_sync``, accumulation through the reducers' ``no_sync``.
- ``gradient_clipping``: ``fabric.clip_gradients`` over the shards, with the ``.grad`` the loop was shown kept.
- ``checkpoint``: ``fabric.save``/``load`` in the Trainer's sharded directory format, or one file
  (``state_dict_type="full"``); ``checkpoint_layout``: where each object of a state goes, what each load takes;
  ``raw_loads``: ``fabric.load_raw``, one object from a raw file, and the frozen-base state every load keeps.
- ``optimizer_steps``: each set-up optimizer's step count, which ends the delayed update's warm-up (saved with it).
- ``async_saves``: ``async_save`` in a Fabric loop, waited for by the next save, a load, teardown and the process's end.

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding, lightning_zero.stage3,
lightning_zero.offload, lightning_zero.checkpoint, lightning_zero.planning, lightning_zero.engine

What the Trainer's front door does too is in the engine, below both; the two doors never import each other.
"""
