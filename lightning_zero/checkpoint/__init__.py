"""Sharded checkpoint IO: each rank writes and reads only what it owns; any layout loads any other.

- ``sharded_checkpoint``: the entry points (save, load at any world size or stage).
- ``full_weights``: ``load_full_state_dict``, full (e.g. pretrained) weights into the shards.
- ``slices``: which flat range of each parameter (and its optimizer state) this rank owns; the load plan.
- ``format``: the on-disk layout over ``torch.distributed.checkpoint`` (flat chunks, the table of contents).
- ``files``: safe reading (no code runs on load), integrity checks and the atomic commit.
- ``local_commit``: the atomic commit of a directory on a local filesystem (with or without ``RENAME_EXCHANGE``),
  and its recovery.
- ``storage``: local paths and fsspec URLs (``s3://``, ``gs://``, ``memory://``); the commit on an object store.
- ``full``: DDP / full checkpoints and plain state dicts as input.
- ``frozen``: ``exclude_frozen_parameters``: adapter-sized checkpoints, the frozen base restored from its source.
- ``sections``: several models in one checkpoint, each under its name; a model loaded from its section.
- ``full_save``: ``state_dict_type="full"``: one ``torch.save`` file as DDP writes it, streamed from the shards.
- ``archive_records``: ``ArchiveRecords``, the storage records of that file's archive and the pickler naming them.
- ``pretrained``: pretrained weights as input: safetensors files, Hugging Face directories, keys matched to the model.
- ``module_state``: a stage-3 model's own ``state_dict()`` and ``load_state_dict()``, true for code we did not write.
- ``model_entries``: what ``on_save_checkpoint`` hooks see of the model, and what a save writes of what they left.
- ``lazy_entry``: ``LazyEntry``, a stage-3 parameter's values in those hooks, read from the shards when used.
- ``saved_entries``: what ``on_load_checkpoint`` sees of a checkpoint, and the model's load from what it left.
- ``async_save``: ``async_save``: a save snapshot into host memory, written by a writer process, committed by a thread.
- ``write_worker``: the writer process of ``async_save`` (a script that imports torch only).
- ``tiered``: checkpoint IO through the memory tiers (``TierStorage``): slices moved one at a time.

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding, lightning_zero.stage3
"""
