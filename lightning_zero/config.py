"""``ZeroConfig``: every knob of the ZeRO strategy, in one frozen, validated dataclass.

The Hydra configs under ``conf/strategy/`` mirror these fields one to one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from lightning_zero.config_checks import (
    ZEROPP_OFF,
    check_async_save,
    check_auto,
    check_checkpointing_policy,
    check_class_names,
    check_non_negative_int,
    check_offload,
    check_offload_optimizer_state,
    check_offload_overlap,
    check_positive_int,
    check_zeropp,
)

DTypeName = Literal["float32", "bfloat16", "float16"]
TierName = Literal["none", "cpu", "disk"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


CheckpointingPolicy = tuple[type[torch.nn.Module] | str, ...] | Callable[[torch.nn.Module], bool]
"""``ZeroConfig.activation_checkpointing_policy``: module classes (or their names), or a predicate on modules."""


def dtype_from_name(name: DTypeName) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """How the strategy shards and communicates model state. Validated once, at construction."""

    stage: Literal[1, 2, 3] = 2
    """Which model state is sharded across data-parallel ranks. 1: optimizer state and fp32 master weights.
    2: also gradients, reduce-scattered in buckets during backward. 3: also parameters, gathered unit by unit just
    before use and freed right after. ``stage="auto"`` (``ZeroStrategy``, ``from_kwargs``) sets ``auto`` instead."""

    auto: bool = False
    """Choose the stage and the memory tiers when fit starts, from the peak memory per rank predicted for the model's
    own training step and the memory there is (``strategy="zero_auto"``, ``ZeroStrategy(stage="auto")``): the first
    of stage 1, stage 2, stage 3, stage 3 with host tiers and (with ``offload_dir``) with disk tiers whose predicted
    peak fits, with ZeRO++'s hpZ and qwZ at stage 3 when the ranks span nodes (Note [automatic configuration] in
    ``planning/auto_config.py``). ``stage`` and the tier fields are then replaced by the choice; every other field is
    kept. The choice is printed with every candidate considered, logged, and recorded in checkpoints."""

    auto_device_budget: int | None = None
    """With ``auto``: bytes of device memory one rank may use. None: the device's free memory when fit starts (on a
    CPU, the host's available memory shared by the node's ranks), the smallest over all ranks."""

    auto_host_budget: int | None = None
    """With ``auto``: bytes of host memory one rank may give the host tier. None: the host's available memory shared
    by the node's ranks. On a CPU device the host tier is the device's memory and counts against
    ``auto_device_budget`` instead."""

    auto_headroom: float = 0.1
    """With ``auto``: the fraction of the device budget kept free for what the prediction does not count (the
    allocator's caching and fragmentation, the CUDA context, libraries); the prediction is within 10% of measured
    peaks on the CPU (``benchmarks/README.md``)."""

    bucket_numel: int = 4_000_000
    """Elements per communication bucket. Parameters are packed into flat buckets of about this size (a parameter is
    never split across buckets, so a bucket can be larger when a single parameter is). Larger buckets mean fewer,
    more efficient collectives; smaller buckets overlap better with backward and, for stage 2, bound the transient
    full-gradient memory."""

    overlap_comm: bool = True
    """Launch each bucket's gradient reduce-scatter from the backward hooks as soon as the bucket is complete, so
    communication overlaps the rest of backward. False: stage 1 reduces every bucket at the optimizer step and
    stage 2 reduces each bucket as it completes but waits for it at once (no overlap; easier to debug)."""

    max_inflight_buckets: int = 2
    """Stage 2: how many buckets may be in flight at once during backward. Each one holds a bucket's full gradients
    until its reduce-scatter completes (a staging buffer on NCCL, the gradients autograd computed on gloo), so this
    bounds stage 2's gradient memory at ``max_inflight_buckets * bucket_numel`` elements above the sharded
    gradients."""

    grad_accumulation: Literal["sharded", "local"] = "sharded"
    """Stages 2 and 3, on the micro-batches of gradient accumulation (``accumulate_grad_batches`` > 1, or backward
    inside ``no_sync()``). ``"sharded"``: reduce-scatter every micro-batch and add into the 1/N gradient shard, so
    gradient memory stays 1/N while communication grows with the number of micro-batches. ``"local"``: keep full
    gradients and communicate once, on the last micro-batch (DDP's traffic, but full gradient memory while
    accumulating). Stage 1 keeps full gradients anyway and always communicates once."""

    reduce_dtype: DTypeName | None = None
    """dtype in which gradients are communicated and averaged. None: the parameters' own dtype. ``"float32"`` with
    bf16 parameters trades twice the gradient traffic for full-precision reduction."""

    wrap_module_classes: tuple[str, ...] | None = None
    """Stage 3: module classes that become their own gather unit, by class name (``"Block"``) or qualified name
    (``"torch.nn.TransformerEncoderLayer"``). None: every module in an ``nn.ModuleList``/``nn.Sequential`` whose
    class repeats there (the layers of a transformer). ``()``: only the size threshold below. Parameters outside
    every unit form the root unit."""

    wrap_min_numel: int = 0
    """Stage 3: also make a module its own unit once it holds at least this many parameter elements not already in
    a smaller unit (children first, as FSDP's size policy). 0 disables the size threshold."""

    leaf_module_classes: tuple[str, ...] | None = None
    """Stage 3: module classes that are never split into several units, by class name (``"MoEBlock"``) or qualified
    name, as ``wrap_module_classes`` takes them (DeepSpeed's ``set_z3_leaf_modules``). No unit is created inside a
    leaf module: its whole subtree is gathered with the unit that contains it (the leaf itself, if
    ``wrap_module_classes`` or ``wrap_min_numel`` makes it one), so ranks gather the same units whichever of its
    children each calls. Name the block of a mixture of experts whose routing may change from step to step. None:
    every non-empty ``nn.ModuleList``/``nn.ModuleDict`` registered under a name containing "expert" (Hugging Face's
    sparse MoE blocks keep their experts so; Note [leaf modules] in ``stage3/wrap_policy.py``). A tuple replaces that
    rule: list every MoE block class, or ``()`` for none. ``nn.MultiheadAttention`` is always a leaf. Classes of
    ``wrap_module_classes`` inside a leaf are not units."""

    prefetch_limit_numel: int | None = None
    """Stage 3: the next unit's all-gather (next in forward order during forward, previous during backward) is
    issued ahead only if the gathered elements, counting units in use and the prefetched one, stay at or below this.
    None: always prefetch one unit ahead. 0: never prefetch."""

    reshard_root_after_forward: bool = True
    """Stage 3: whether the root unit (the parameters outside every unit: embeddings, final norm, an output head)
    is freed when the forward ends and gathered again when backward starts. True: every unit is gathered twice per
    step, the ZeRO paper's 3Ψ(N-1)/N bytes per rank. False (FSDP2's behaviour for its root): a forward whose output
    will be differentiated keeps the root gathered into backward, which needs it first; that saves the root's
    second all-gather, exposed at the start of every backward, but holds the full root through the loss and its
    gradient, which is often where a step's memory peaks (measured in ``benchmarks/README.md``)."""

    persistence_threshold: int = 0
    """Stage 3: parameters with fewer elements than this are not partitioned: every rank keeps them gathered (like
    stage 2), saving their gathers at the cost of their full size on every rank. Norm weights and biases are the
    usual candidates; in a flat unit they add no collective of their own, so the default keeps everything sharded."""

    check_rank_divergence: bool | None = None
    """Stage 3, after the first step: before each unit's all-gather, ranks exchange the unit's index (a few bytes)
    and raise an error naming both units if they differ, instead of pairing mismatched collectives and hanging.
    Reading the answer is a host synchronization per unit, which stalls a GPU pipeline: None checks on CPU devices
    only. In the first step every gather is checked whatever this says: that is where units whose use depends on the
    data are found and merged into their enclosing unit (Note [data-dependent units])."""

    keep_reduce_buffers: bool | None = None
    """Whether the buffers the gradient reduction collects and receives buckets in (a few buckets' worth: those in
    flight and filling) stay allocated between steps. True saves allocating them every backward; False frees them
    at the end of each backward, so they do not sit on top of the next forward's activations. None: True for stages
    1 and 2 (buckets of ``bucket_numel``), False for stage 3 (buckets as large as a unit)."""

    broadcast_buffers: bool = True
    """As DDP's ``broadcast_buffers``: before a forward of the training loop, every rank takes rank 0's buffers
    (BatchNorm running statistics), so the ranks keep one model. Synchronized exactly when DDP does: before a
    training or (during ``fit``) validation step whose previous step was a training step outside gradient
    accumulation (Note [buffers follow rank 0] in ``engine/buffers.py``). False: each rank keeps its own."""

    elementwise_optimizers: tuple[str, ...] = ()
    """Optimizer classes, by class name (``"Lion"``) or qualified name, that may be sharded although they are not
    torch's element-wise ones (SGD, Adam, AdamW, ...). ZeRO steps a flat slice of each parameter, so only optimizers
    whose update of an element reads nothing but that element's gradient and state give the same result; anything
    else is refused. A listed optimizer is still stepped on a small probe, whole and cut into flat pieces, and refused
    if the two differ."""

    activation_checkpointing_policy: CheckpointingPolicy | None = None
    """Which modules recompute their activations in backward instead of keeping them (activation checkpointing), as
    FSDP's strategy takes it: module classes (a set of classes; from YAML a list of class names or qualified names,
    as ``wrap_module_classes`` takes them), or a callable ``(module) -> bool``. Each module selected is wrapped in
    torch's non-reentrant checkpoint wrapper when the strategy sets up, at every stage, and at stage 3 before the
    units are formed, so a wrapped layer is still a unit. Parameter and checkpoint names stay those of the unwrapped
    model (Note [checkpoint wrappers keep the names] in ``sharding/activation_checkpointing.py``). None: nothing is
    wrapped."""

    collective_timeout_s: float = 1800.0
    """Seconds any collective may wait for the other ranks before failing. A rank that dies or hangs then fails
    the others after at most this long instead of leaving them blocked forever; lower it for fast failure."""

    # -- ZeRO++ (stage 3): Note [ZeRO++ on a node topology] in ``stage3/zeropp.py`` --------------------------------
    ranks_per_node: int | None = None
    """How many consecutive ranks share a node (a fast local link), for ZeRO++'s hierarchy and for metering
    communication by link. None: from the cluster environment (``LOCAL_WORLD_SIZE`` under torchrun,
    ``SLURM_NTASKS_PER_NODE`` under SLURM, the devices per node under Lightning), else all ranks on one node. Set it
    to simulate several nodes on one machine (4 ranks as 2 nodes x 2: ``ranks_per_node=2``)."""

    quantize_weights: bool = False
    """ZeRO++ qwZ, stage 3: the forward all-gather of each unit sends every shard block-quantized to int8 (one
    scale per ``quantization_block`` elements) and dequantizes on arrival, halving the gather's bytes for bf16
    parameters. Only the gathered copy is quantized: the shards, fp32 masters and checkpoints stay exact."""

    hpz_partition_size: int = 1
    """ZeRO++ hpZ, stage 3: after a unit's forward all-gather every rank keeps a secondary shard of it, 1/size of
    the unit, partitioned over ``hpz_partition_size`` consecutive ranks of its node; the backward all-gather reads
    those instead of the primary shards, so it never leaves the node. 1: off; usually ``ranks_per_node``. Costs
    params/size bytes per rank, dropped at the optimizer step."""

    quantize_gradients: bool = False
    """ZeRO++ qgZ, stage 3: each bucket's gradient reduce-scatter becomes a hierarchical all-to-all, quantized to
    ``gradient_quantization_bits`` with block scales: within the node, then across nodes, averaged in fp32 and
    landing in the same gradient shard."""

    quantization_block: int = 2048
    """Elements per quantization scale, for ``quantize_weights`` and ``quantize_gradients``: the per-element error
    is at most half of the block's largest magnitude / 127 (int8) or / 7 (int4). Smaller blocks are more exact and
    send more scales (4 bytes per block)."""

    gradient_quantization_bits: Literal[4, 8] = 4
    """Bits per gradient element under ``quantize_gradients``: 4 (two per byte; ZeRO++'s choice) or 8."""
    offload_optimizer: TierName = "none"
    """Where the fp32 master weights and the optimizer state of this rank's shard live between steps (stages 1-3;
    ZeRO-Offload and ZeRO-Infinity). ``"none"``: on the device. ``"cpu"``: in host memory, stepped there with
    torch's CPU kernels (on a CPU device host and device are one memory and nothing moves). ``"disk"``: in files
    under ``offload_dir``, read and written bucket by bucket around the step; at stage 3 the reduced gradient shards
    go there too as their reduce-scatter completes (Note [gradients on disk] in ``offload/tiered_grad_reducer.py``).
    With fp32 parameters the masters are the parameter shards themselves: they move with ``offload_params``."""

    offload_params: TierName = "none"
    """Stage 3 only: where this rank's parameter shards live between uses. ``"disk"``: in files under
    ``offload_dir``, read ahead of each unit's gather along the order units are used in. ``"cpu"``: in host memory
    (nothing moves on a CPU device). Stages 1 and 2 hold full parameters on every rank and refuse it."""

    offload_dir: str | None = None
    """Directory for the ``"disk"`` tiers. Each job and rank gets its own sub-directory in it, created at setup and
    removed when the job ends (also when it fails). An absolute path must exist and be writable; a relative path is
    taken under the Trainer's ``default_root_dir`` and created. Required whenever a tier is ``"disk"``."""

    offload_ratio: float = 1.0
    """The fraction (0 < r <= 1) of the optimizer state (masters and moments) that ``offload_optimizer`` moves, by
    elements, bucket by bucket in step order (ZeRO-Offload++); the rest stays on the device."""

    offload_optimizer_state: Literal["with_masters", "disk"] = "with_masters"
    """Where the host step's optimizer state (Adam's moments, 8 of the 16 bytes per parameter) lives between steps.
    ``"with_masters"``: where ``offload_optimizer`` puts the masters. ``"disk"``: with ``offload_optimizer="cpu"``,
    in files under ``offload_dir`` beside the host masters, read ahead of each bucket's host step and written behind
    it, so that host memory and disk add up (Note [moments on disk] in ``offload/host_moments.py``). Needs torch's
    Adam or AdamW with the fused kernels the host tier chooses; refused with ``offload_overlap="delayed"``."""

    offload_overlap: Literal["exact", "delayed"] = "exact"
    """How the host tier's step (``offload_optimizer="cpu"`` on an accelerator) meets the device's work.
    ``"exact"``: every step's update is applied before the next forward, as without offloading. ``"delayed"``:
    ZeRO-Offload's one-step delayed parameter update: after ``offload_overlap_warmup`` steps the host updates the
    weights with step i's gradients while the device runs step i + 1 on the weights before that update, which hides
    the host step behind the device's (the gradients are one step stale: ``benchmarks/README.md`` measures the loss
    curve against the exact step). Note [delayed parameter update] in ``offload/host_steps.py``."""

    offload_overlap_warmup: int = 40
    """``offload_overlap="delayed"``: the exact steps before the first delayed one (by the ``Trainer``'s
    ``global_step``), so that the large, fast-changing updates of early training are not applied stale."""

    state_dict_type: Literal["sharded", "full"] = "sharded"
    """What ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write, as ``FSDPStrategy(state_dict_type=...)``.
    ``"sharded"``: a directory in which each rank writes what it owns (``checkpoint/``). ``"full"``: one Lightning
    ``.ckpt`` file as a DDP run writes it (full weights; the optimizers' state in torch's format unless
    ``save_weights_only``), which plain ``torch.load`` and a DDP run read, put together parameter by parameter on
    rank 0, which writes it (Note [full checkpoint streamed] in ``checkpoint/full_save.py``); local paths only."""

    async_save: bool = False
    """Write sharded checkpoints in the background: ``trainer.save_checkpoint`` (and ``ModelCheckpoint``) copies what
    this rank writes into host memory and returns, and a writer process writes it and a thread commits it while
    training goes on, with the same commit protocol and format; at most one save is in flight, and the next save, a
    load or the end of training waits for it (Note [asynchronous save] in ``checkpoint/async_save.py``). Costs host
    memory for the copy of the rank's state, kept between saves. Not with ``state_dict_type="full"`` nor the disk
    tier; the Trainer only (a Fabric loop saves synchronously and refuses it)."""

    exclude_frozen_parameters: bool = False
    """Leave parameters with ``requires_grad=False`` out of checkpoints (DeepSpeed's option of that name): a LoRA
    checkpoint holds the adapters and their optimizer state, not the frozen base. A resume restores the base from the
    pretrained weights the run loaded (``fit(ckpt_path=<pretrained>)``, ``load_full_state_dict(trainer.strategy,
    ...)``) or, when none was loaded, as the model is built (``from_pretrained`` in ``__init__``); it refuses when
    that source is gone (Note [frozen base restored from its source] in ``checkpoint/frozen.py``)."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (1, 2, 3):
            raise ValueError(
                f"Invalid ZeroConfig.stage: {self.stage!r}. Expected 1, 2 or 3. HINT: to have it chosen when fit "
                "starts, set auto=True (ZeroStrategy(stage='auto'), strategy='zero_auto')."
            )
        check_auto(self)
        if isinstance(self.collective_timeout_s, bool) or not (
            isinstance(self.collective_timeout_s, (int, float)) and self.collective_timeout_s > 0
        ):
            raise ValueError(
                f"Invalid ZeroConfig.collective_timeout_s: {self.collective_timeout_s!r}. Expected a positive number "
                "of seconds."
            )
        check_positive_int("bucket_numel", self.bucket_numel)
        check_positive_int("max_inflight_buckets", self.max_inflight_buckets)
        check_non_negative_int("wrap_min_numel", self.wrap_min_numel)
        check_non_negative_int("persistence_threshold", self.persistence_threshold)
        if self.prefetch_limit_numel is not None:
            check_non_negative_int("prefetch_limit_numel", self.prefetch_limit_numel)
        if self.grad_accumulation not in ("sharded", "local"):
            raise ValueError(
                f"Invalid ZeroConfig.grad_accumulation: {self.grad_accumulation!r}. Expected 'sharded' or 'local'."
            )
        if self.keep_reduce_buffers is not None and not isinstance(self.keep_reduce_buffers, bool):
            raise TypeError(
                f"Invalid ZeroConfig.keep_reduce_buffers: {self.keep_reduce_buffers!r}. Expected True, False or None."
            )
        for name in (
            "overlap_comm",
            "broadcast_buffers",
            "reshard_root_after_forward",
            "exclude_frozen_parameters",
            "async_save",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Invalid ZeroConfig.{name}: {getattr(self, name)!r}. Expected True or False.")
        if self.check_rank_divergence is not None and not isinstance(self.check_rank_divergence, bool):
            raise TypeError(
                f"Invalid ZeroConfig.check_rank_divergence: {self.check_rank_divergence!r}. Expected True, False or "
                "None (on CPU devices only)."
            )
        check_class_names("wrap_module_classes", self, "('Block',) or ('torch.nn.TransformerEncoderLayer',)")
        check_class_names("leaf_module_classes", self, "('MoEBlock',) or ('mymodels.moe.SparseMoE',)")
        check_checkpointing_policy(self)
        optimizers: object = self.elementwise_optimizers
        names = list(optimizers) if isinstance(optimizers, (tuple, list)) else None
        if names is None or not all(isinstance(n, str) and n for n in names):
            raise TypeError(
                f"Invalid ZeroConfig.elementwise_optimizers: {optimizers!r}. Expected a tuple of optimizer class "
                "names, e.g. ('Lion',)."
            )
        object.__setattr__(self, "elementwise_optimizers", tuple(names))
        if self.reduce_dtype is not None and self.reduce_dtype not in _DTYPES:
            raise ValueError(
                f"Invalid ZeroConfig.reduce_dtype: {self.reduce_dtype!r}. Expected None or one of {sorted(_DTYPES)}."
            )
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(
                f"Invalid ZeroConfig.state_dict_type: {self.state_dict_type!r}. Expected 'sharded' or 'full'."
            )
        check_zeropp(self)
        check_offload(self)
        check_offload_overlap(self)
        check_offload_optimizer_state(self)
        check_async_save(self)

    @property
    def uses_zeropp(self) -> bool:
        """Whether any ZeRO++ switch is on."""
        return any(getattr(self, n) != off for n, off in ZEROPP_OFF.items())

    @property
    def offloads_to_disk(self) -> bool:
        """Whether any tier lives in files under ``offload_dir``."""
        return "disk" in (self.offload_optimizer, self.offload_params, self.offload_optimizer_state)

    @property
    def keeps_reduce_buffers(self) -> bool:
        """``keep_reduce_buffers`` with None resolved for this stage."""
        return self.stage < 3 if self.keep_reduce_buffers is None else self.keep_reduce_buffers

    def checks_rank_divergence_on(self, device: torch.device) -> bool:
        """``check_rank_divergence`` with None resolved for ``device``."""
        if self.check_rank_divergence is None:
            return device.type == "cpu"
        return self.check_rank_divergence

    @classmethod
    def from_arguments(cls, config: ZeroConfig | None, kwargs: dict[str, Any]) -> ZeroConfig:
        """The config a strategy was given (``ZeroStrategy``, ``ZeroFabricStrategy``): ``config``, or its fields as
        keywords, not both."""
        if config is not None and kwargs:
            raise TypeError(
                f"Pass either `config=ZeroConfig(...)` or ZeroConfig fields as keywords, not both (got "
                f"{sorted(kwargs)} as well). HINT: use `dataclasses.replace(config, ...)` to change a config."
            )
        return config if config is not None else cls.from_kwargs(**kwargs)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ZeroConfig:
        """Build a config from keyword arguments, naming any unknown keyword and the known ones."""
        known = {f.name for f in fields(cls)}
        if kwargs.get("stage") == "auto":  # ZeroStrategy(stage="auto"): the stage is chosen when fit starts
            kwargs = {**kwargs, "stage": 3, "auto": True}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"Unknown ZeroConfig option(s) {unknown}. Valid options are: {sorted(known)}. "
                "HINT: check the spelling in `ZeroStrategy(...)` or in your `strategy` config."
            )
        return cls(**kwargs)
