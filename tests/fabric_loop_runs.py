"""Fabric training loops written the way public Fabric projects write theirs (a LitGPT-style pretraining script, a
LoRA fine-tuning script, a nanoGPT-style loop), run under Fabric's DDP (the oracle) and under ``Fabric(strategy=
"zero*")`` unchanged. They exercise the Fabric calls such scripts make, in their order: ``launch``,
``seed_everything``, ``init_module(empty_init=world_size > 1)``, ``setup`` then ``setup_optimizers``,
``setup_dataloaders``, accumulation under ``no_backward_sync``, clipping, learning rates set by hand and by a
scheduler, validation and sampling between steps, ``all_reduce``, ``barrier``, ``log_dict``, ``save``/``load``
mid-run, ``load_raw`` (or ``model.load_state_dict``) of a ``lit_model.pth`` and a filtered adapter save. Everything
here runs inside a rank started by ``tests.harness.run_distributed`` with ``init_process_group=False``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroFabricStrategy
from lightning_zero.models.gpt import GPT, GPTConfig
from tests.fabric_loop_models import ListLogger, LoopGPT, ScoringGPT, initialize_weights, lora_filter, lora_llama

VOCAB, SEQ = 64, 16


def token_loaders(batch_size: int = 2) -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(7)
    train = TensorDataset(torch.randint(0, VOCAB, (32, SEQ + 1), generator=g))
    val = TensorDataset(torch.randint(0, VOCAB, (8, SEQ + 1), generator=g))
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(3)),
        DataLoader(val, batch_size=batch_size),
    )


def cycle(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


@torch.no_grad()
def validate(fabric: Fabric, model: Any, loader: Any, max_iters: int) -> Tensor:
    fabric.barrier()
    model.eval()
    losses = []
    for k, (batch,) in enumerate(loader):
        if k >= max_iters:
            break
        input_ids = batch[:, : model.max_seq_length].contiguous()
        targets = batch[:, 1 : model.max_seq_length + 1].contiguous()
        logits = model(input_ids)
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    model.train()
    fabric.barrier()
    return torch.stack(losses).mean()


@torch.inference_mode()
def generate(model: Any, prompt: Tensor, new_tokens: int) -> Tensor:
    """Greedy decoding as LitGPT's ``generate`` calls the model: under inference mode, one forward per token,
    ``input_pos`` given."""
    tokens = prompt
    for _ in range(new_tokens):
        input_pos = torch.arange(tokens.size(0), device=tokens.device)
        logits = model(tokens[None], input_pos)[0, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)])
    return tokens


@dataclass
class Pretrain:
    """What one pretraining run returns: per-iteration losses, the mean over ranks, validation losses, samples, what
    the logger got (rank 0), the final full weights, the dtypes of the training logits and validation losses."""

    losses: list[float]
    reduced: list[float]
    val: list[float]
    samples: list[list[int]]
    logged: list[tuple[int | None, dict[str, float]]]
    weights: dict[str, Tensor]
    state: dict[str, Any]
    dtypes: set[str]


def pretrain(
    strategy: str | ZeroFabricStrategy,
    out_dir: str,
    precision: str = "32-true",
    max_iters: int = 8,
    save_at_step: int | None = None,
    resume: str | None = None,
) -> Pretrain:
    """LitGPT's pretraining script on ``LoopGPT``: accumulation of 2 micro-batches, clipping at 1.0, a cosine
    schedule set by hand, validation, sampling and logging every 2 steps, ``fabric.save`` of the whole state at
    ``save_at_step`` and ``fabric.load`` of it when ``resume`` (skipping the iterations done, as LitGPT does)."""
    logger = ListLogger()
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2, precision=precision, loggers=[logger])  # type: ignore[arg-type]
    fabric.launch()
    fabric.print("hyperparameters", {"max_iters": max_iters})
    fabric.seed_everything(1337)
    config = GPTConfig.tiny(vocab_size=VOCAB, block_size=SEQ, n_embd=32, n_head=2, n_layer=2, bias=False)
    with fabric.init_module(empty_init=(fabric.world_size > 1)):
        model = LoopGPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    train_loader, val_loader = fabric.setup_dataloaders(*token_loaders())
    model.max_seq_length = SEQ - 4  # through Fabric's wrapper, after setup: the position cache is rebuilt
    state: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "hparams": {"lr": 4e-3, "name": "loop"},
        "iter_num": 0,
        "step_count": 0,
    }
    if resume is not None:
        fabric.load(resume, state)
    accumulate, eval_interval = 2, 2
    result = Pretrain([], [], [], [], [], {}, {}, set())
    validate(fabric, model, val_loader, max_iters=1)  # sanity check, as LitGPT's fit starts with
    initial_iter = state["iter_num"]
    for current, (batch,) in enumerate(cycle(train_loader)):
        if current < initial_iter:  # resuming: skip what the checkpointed run consumed
            continue
        if state["iter_num"] >= max_iters:
            break
        lr = _cosine_lr(state["iter_num"], warmup=2, max_iters=max_iters, peak=4e-3)
        for group in optimizer.param_groups:
            group["lr"] = lr
        state["iter_num"] += 1
        input_ids = fabric.to_device(batch[:, : model.max_seq_length].contiguous())
        targets = batch[:, 1 : model.max_seq_length + 1].contiguous()
        is_accumulating = state["iter_num"] % accumulate != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            with fabric.autocast():
                logits = model(input_ids)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            fabric.backward(loss / accumulate)
        result.losses.append(loss.item())
        result.dtypes.add(f"train {logits.dtype}")
        result.reduced.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
        if not is_accumulating and state["step_count"] % eval_interval == 0:
            val_loss = validate(fabric, model, val_loader, max_iters=2)
            result.val.append(val_loss.item())
            result.dtypes.add(f"val {val_loss.dtype}")
            result.samples.append(generate(model, torch.tensor([1, 2, 3]), new_tokens=4).tolist())
            fabric.log_dict({"val_loss": val_loss.item(), "lr": lr}, step=state["iter_num"])
            fabric.barrier()
        if not is_accumulating and state["step_count"] == save_at_step:
            fabric.save(Path(out_dir) / f"step-{state['step_count']:08d}" / "lit_model.pth", state)
    result.logged = logger.logged
    result.weights = full_weights(fabric, model)
    result.state = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    return result


def _cosine_lr(it: int, warmup: int, max_iters: int, peak: float) -> float:
    if it < warmup:
        return peak * (it + 1) / warmup
    return 0.1 * peak + 0.45 * peak * (1 + math.cos(math.pi * (it - warmup) / (max_iters - warmup)))


def full_weights(fabric: Fabric, model: Any) -> dict[str, Tensor]:
    strategy = fabric.strategy
    if isinstance(strategy, ZeroFabricStrategy):
        with strategy.gathered_parameters():
            return {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
    return {n: p.detach().float().clone() for n, p in model.module.named_parameters()}


def pretrain_runs(stage: int, out_dir: str, precision: str = "32-true") -> list[Pretrain]:
    """[DDP uninterrupted, ZeRO uninterrupted, ZeRO saving at step 2 then resumed from it in a new Fabric]."""
    reference = pretrain("ddp", out_dir, precision)
    zero = partial(ZeroFabricStrategy, stage=stage, bucket_numel=2_000)
    uninterrupted = pretrain(zero(), out_dir, precision, save_at_step=2)
    resumed = pretrain(zero(), out_dir, precision, resume=str(Path(out_dir) / "step-00000002" / "lit_model.pth"))
    return [reference, uninterrupted, resumed]


@dataclass
class Finetune:
    losses: list[float]
    val: list[float]
    samples: list[list[int]]
    lrs: list[float]
    weights: dict[str, Tensor]
    trainable: list[str]


def finetune(
    strategy: str | ZeroFabricStrategy,
    out_dir: str,
    precision: str = "32-true",
    on_meta: bool = False,
    load: str = "load_raw",
) -> Finetune:
    """LitGPT's LoRA fine-tuning script on a peft Llama: built under ``init_module(empty_init=world_size > 1)``,
    ``setup_module`` then an optimizer over ``model.parameters()`` (the frozen base included, as LitGPT passes them)
    and a warm-up ``LambdaLR``, pretrained base weights from a ``lit_model.pth`` by ``load_raw(strict=False)`` (or,
    ``load="load_state_dict"``, as LitGPT's ``load_checkpoint`` loads under a strategy other than FSDP's),
    accumulation, clipping by value, validation and sampling (Hugging Face's ``generate``, marked as a forward method),
    a filtered adapter save every 2 steps."""
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    fabric.seed_everything(1337)
    checkpoint_path = Path(out_dir) / "lit_model.pth"
    if fabric.global_rank == 0 and not checkpoint_path.exists():  # "pretrained" weights: another seed's base
        torch.manual_seed(99)
        pretrained = lora_llama().state_dict()
        torch.save({k: v for k, v in pretrained.items() if not lora_filter(k, v)}, checkpoint_path)
    fabric.barrier()
    # LitGPT's empty_init=(world_size > 1) builds on meta under a sharded strategy, where the adapters get peft's
    # initialization but not DDP's draws (Note [peft adapters on meta]); Fabric's DDP would leave their memory
    # uninitialized. So both build as usual for an exact comparison, unless `on_meta`.
    with fabric.init_module(empty_init=(fabric.world_size > 1 and on_meta)):
        model = lora_llama()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    fabric.print(f"Number of trainable parameters: {sum(p.numel() for p in model.parameters() if p.requires_grad)}")
    model = fabric.setup_module(model)
    model.mark_forward_method("generate")  # Hugging Face's, through the strategy's forward as under DDP
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.02))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    if load == "load_raw":
        fabric.load_raw(checkpoint_path, model, strict=False)
    else:
        state_dict = torch.load(checkpoint_path, mmap=True, weights_only=True)
        model.load_state_dict(state_dict.get("model", state_dict), strict=False)
    from tests.third_party_models import _token_batch

    result = Finetune([], [], [], [], {}, trainable)
    accumulate, step_count = 2, 0
    for iter_num in range(1, 9):
        batch = fabric.to_device(_token_batch(fabric.global_rank, iter_num))
        is_accumulating = iter_num % accumulate != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids=batch["input_ids"]).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
            fabric.backward(loss / accumulate)
        result.losses.append(loss.item())
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, clip_val=0.5)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step_count += 1
            result.lrs.append(optimizer.param_groups[0]["lr"])
        if not is_accumulating and step_count % 2 == 0:
            model.eval()
            with torch.no_grad():
                val = model(input_ids=_token_batch(5, 0)["input_ids"]).logits
                result.val.append(
                    F.cross_entropy(val[:, :-1].flatten(0, 1), _token_batch(5, 0)["labels"][:, 1:].flatten()).item()
                )
                prompt = torch.tensor([[1, 2, 3]])
                sample = model.generate(input_ids=prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
                result.samples.append(sample[0].tolist())
            model.train()
            path = Path(out_dir) / type(fabric.strategy).__name__ / f"step-{step_count:06d}" / "lit_model.pth.lora"
            fabric.save(path, {"model": model}, filter={"model": lora_filter})
    result.weights = full_weights(fabric, model)
    return result


def finetune_runs(
    stage: int, out_dir: str, precision: str = "32-true", on_meta: bool = False, load: str = "load_raw"
) -> list[Finetune]:
    """[Fabric DDP, ZeRO at ``stage``, built on meta when ``on_meta``], loading the base with ``load``."""
    zero = finetune(ZeroFabricStrategy(stage=stage), out_dir, precision, on_meta=on_meta, load=load)
    return [finetune("ddp", out_dir, precision, load=load), zero]


@dataclass
class NanoGPT:
    losses: list[float]
    evals: list[float]
    samples: list[list[int]]
    weights: dict[str, Tensor]
    extra: dict[str, Any]


def nanogpt(strategy: str | ZeroFabricStrategy, precision: str = "32-true") -> NanoGPT:
    """A nanoGPT-style loop on Fabric: ranks seeded differently (the model built before setup, so only rank 0's
    initial weights count), weight-decay param groups from the model, ``fabric.setup(model, optimizer)`` together,
    a learning rate set by hand, accumulation with clipping, ``estimate_loss`` under ``eval``/``no_grad``, and
    sampling through the model's own ``generate`` marked as a forward method; the raw model read through
    ``model.module`` and ``model.config``."""
    from lightning_zero.models.param_groups import param_groups_with_weight_decay

    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    fabric.seed_everything(1337 + fabric.global_rank)
    model = ScoringGPT(GPTConfig.tiny(vocab_size=VOCAB, block_size=SEQ, n_embd=32, n_head=2, bias=False))
    groups = param_groups_with_weight_decay(model, 0.1)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95)))
    model.mark_forward_method("generate")
    model.mark_forward_method("loss")
    model.mark_forward_method("score")
    block_size = model.config.block_size
    result = NanoGPT([], [], [], {}, {})

    def get_batch(split: int, i: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1000 * split + 10 * fabric.global_rank + i)
        data = torch.randint(0, VOCAB, (4, block_size + 1), generator=g)
        return fabric.to_device((data[:, :-1], data[:, 1:]))

    @torch.no_grad()
    def estimate_loss() -> float:
        model.eval()
        losses = torch.stack(
            [F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in map(get_batch, [1, 1], [0, 1])]
        )
        model.train()
        return float(fabric.all_reduce(losses.mean(), reduce_op="mean"))

    accumulate = 2
    for iter_num in range(4):
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * min(1.0, (iter_num + 1) / 2)
        if iter_num % 2 == 0:
            result.evals.append(estimate_loss())
        for micro in range(accumulate):
            x, y = get_batch(0, iter_num * accumulate + micro)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = model.loss(x, y) / accumulate  # a marked method: through the strategy's forward
                fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(loss.item() * accumulate)
    model.eval()
    prompt = fabric.to_device(torch.tensor([[1, 2, 3]]))
    result.samples = model.generate(prompt, max_new_tokens=4, temperature=0.0).tolist()
    result.extra["sample dtype"] = str(model(prompt).dtype)
    scores = model.score(prompt)
    result.extra["score dtype"] = str(scores.dtype)
    result.extra["scores"] = scores.float().sum().item()
    result.extra["config"] = model.module.config.n_layer
    result.weights = full_weights(fabric, model)
    return result


def nanogpt_runs(stage: int, precision: str = "32-true") -> list[NanoGPT]:
    return [nanogpt("ddp", precision), nanogpt(ZeroFabricStrategy(stage=stage, bucket_numel=2_000), precision)]


def state_dict_saves(out_dir: str) -> dict[str, Any]:
    """lit-llama's adapter save, ``fabric.save(path, {"weights": <the model's state dict>})``, at stage 3: written
    outside a gather (DTensors saved whole) and inside ``gathered_parameters`` (copies); the parameters themselves
    (``keep_vars=True``: placeholders) refused. Also a method that calls the model's layers, unmarked: refused as
    under DDP (Note [marked forward methods])."""

    fabric = Fabric(strategy=ZeroFabricStrategy(stage=3), accelerator="cpu", devices=2)
    fabric.launch()
    model = fabric.setup(ScoringGPT(GPTConfig.tiny(vocab_size=VOCAB, block_size=SEQ, n_embd=32, n_head=2, bias=False)))
    unmarked = ""
    try:
        model.score(torch.tensor([[1, 2]]))
    except RuntimeError as error:
        unmarked = str(error)
    fabric.save(Path(out_dir) / "outside.pth", {"weights": model.state_dict()})
    refused = ""
    try:
        fabric.save(Path(out_dir) / "parameters.pth", {"weights": model.state_dict(keep_vars=True)})
    except ValueError as error:
        refused = str(error)
    strategy = fabric.strategy
    assert isinstance(strategy, ZeroFabricStrategy)
    with strategy.gathered_parameters():
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        fabric.save(Path(out_dir) / "gathered.pth", {"weights": model.state_dict()})
    return {"refused": refused, "weights": weights, "unmarked": unmarked}


def compiled(strategy: str | ZeroFabricStrategy) -> list[float]:
    """LitGPT's optional ``torch.compile(model)`` before ``fabric.setup``: Fabric compiles what the strategy returns
    (``aot_eager``, to keep the test to the tracing); accumulation over two micro-batches."""
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)  # type: ignore[arg-type]
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.compile(GPT(GPTConfig.tiny(vocab_size=VOCAB, block_size=SEQ, bias=False)), backend="aot_eager")
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for i in range(4):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(i + fabric.global_rank))
        with fabric.no_backward_sync(model, enabled=i % 2 == 0):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            fabric.backward(loss / 2)
        if i % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def compiled_runs(stage: int) -> list[list[float]]:
    return [compiled("ddp"), compiled(ZeroFabricStrategy(stage=stage))]
