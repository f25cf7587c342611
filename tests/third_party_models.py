"""Small models built from code we did not write (Hugging Face ``transformers``, ``peft``, Lightning's demos, stock
``torch.nn``) and the patterns they bring with them: frozen parameters, unused parameters, data-dependent routing,
BatchNorm buffers, an fp32 buffer next to low-precision weights, recurrent layers, non-tensor outputs and
``torch.compile``.

Every builder returns a :class:`Fixture`: a seeded (same weights on every call and every rank) ``nn.Module``, a
``batch(rank, step)`` function giving each rank its own fixed data, and a ``loss(model, batch)`` function. All models
are tiny (a few thousand parameters) so a 6-step Trainer fit at world size 2 takes seconds on CPU.

:class:`ProbeModule` runs any of them under Lightning, and :func:`fit_probe` fits one with a given strategy and
precision and returns the per-step losses and the final full weights (gathered under stage 3). It is meant to run
inside a rank started by ``tests.harness.run_distributed(..., init_process_group=False)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader

Batch = Any
Optimizer = Literal["adamw", "sgd", "plain_sgd"]
SEED = 1234


@dataclass(frozen=True)
class Fixture:
    model: nn.Module
    batch: Callable[[int, int], Batch]  # (rank, step) -> the batch that rank trains on at that step
    loss: Callable[[nn.Module, Batch], Tensor]
    unused_parameters: bool = False  # some trainable parameters get no gradient on some rank in some step
    mixed_precision: bool = False  # worth probing in "bf16-mixed" as well as "32-true"


def _generator(rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(10_000 * (rank + 1) + step)


# -- Hugging Face ---------------------------------------------------------------------------------------------------

HF_VOCAB = 96
HF_SEQ = 16


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=HF_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def _token_batch(rank: int, step: int) -> dict[str, Tensor]:
    tokens = torch.randint(0, HF_VOCAB, (4, HF_SEQ), generator=_generator(rank, step))
    return {"input_ids": tokens, "labels": tokens.clone()}  # HF shifts the labels itself


def _hf_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    loss: Tensor = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    return loss


def hf_causal_lm() -> Fixture:
    """``LlamaForCausalLM`` from a config: 2 layers, hidden 32, vocab 96, eager attention; loss from ``labels=``."""
    return Fixture(_llama(), _token_batch, _hf_loss, mixed_precision=True)


def hf_lora() -> Fixture:
    """The Llama above under ``peft`` LoRA (r=4 on q/v projections): frozen base, trainable adapters."""
    from peft import LoraConfig, get_peft_model

    base = _llama()
    torch.manual_seed(SEED + 1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return Fixture(get_peft_model(base, config), _token_batch, _hf_loss, mixed_precision=True)


def hf_prompt_tuning() -> Fixture:
    """``peft`` prompt tuning (4 virtual tokens, random init): only the virtual-token embedding is trainable.

    ``PeftModelForCausalLM`` is a plain ``nn.Module``: it prepends the virtual tokens and pads ``labels`` itself.
    """
    from peft import PromptTuningConfig, TaskType, get_peft_model

    base = _llama()
    torch.manual_seed(SEED + 2)
    config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    return Fixture(get_peft_model(base, config), _token_batch, _hf_loss, mixed_precision=True)


def hf_gpt2() -> Fixture:
    """``GPT2LMHeadModel`` from a config: ``Conv1D`` projections, the LM head tied to the token embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=HF_VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0
    )
    config.attn_pdrop = 0.0
    torch.manual_seed(SEED)
    return Fixture(GPT2LMHeadModel(config), _token_batch, _hf_loss, mixed_precision=True)


def _short_token_batch(rank: int, step: int) -> dict[str, Tensor]:
    tokens = torch.randint(0, HF_VOCAB, (1, 6), generator=_generator(rank, step))
    return {"input_ids": tokens, "labels": tokens.clone()}


def hf_mixtral() -> Fixture:
    """``MixtralForCausalLM`` from a config: 2 layers, each a sparse MoE block of 8 experts, top-1 routing, no router
    jitter. Batches of 6 tokens reach a few experts each, a different few on each rank and at each step (experts
    a rank calls later that it did not call in the first step). Its experts are one module of 3-D parameters
    (transformers 5) called by every rank; an expert no token reached gets a zero slice of their gradient."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=HF_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=8,
        num_experts_per_tok=1,
        router_jitter_noise=0.0,
        attn_implementation="eager",
        experts_implementation="eager",  # a loop over the experts that received a token, skipping the others
    )
    torch.manual_seed(SEED)
    return Fixture(MixtralForCausalLM(config), _short_token_batch, _hf_loss)


def hf_mixtral_routing(rank: int, steps: int) -> list[list[list[int]]]:
    """The experts each layer of ``hf_mixtral`` routes each step's batch of ``rank`` to, by the initial router."""
    fixture = hf_mixtral()
    with torch.no_grad():
        routed = []
        for step in range(steps):
            out = fixture.model(input_ids=fixture.batch(rank, step)["input_ids"], output_router_logits=True)
            routed.append([sorted(set(logits.argmax(-1).tolist())) for logits in out.router_logits])
    return routed


def _short_seq2seq_batch(rank: int, step: int) -> dict[str, Tensor]:
    g = _generator(rank, step)
    return {
        "input_ids": torch.randint(1, HF_VOCAB, (1, 6), generator=g),
        "labels": torch.randint(1, HF_VOCAB, (1, 3), generator=g),
    }


def hf_switch() -> Fixture:
    """``SwitchTransformersForConditionalGeneration`` from a config: every block of the encoder and the decoder
    has a sparse MLP of 4 experts in a ``ModuleDict``, top-1 routing without jitter, and calls only the experts
    that received a token (a few of 6 or 3 tokens): which experts run differs between ranks and steps, and an
    expert no token reached gets no gradient."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(
        vocab_size=HF_VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=2,
        num_sparse_encoder_layers=2,
        num_sparse_decoder_layers=2,
        num_heads=4,
        num_experts=4,
        expert_capacity=64,
        router_jitter_noise=0.0,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(SEED)
    model = SwitchTransformersForConditionalGeneration(config)
    return Fixture(model, _short_seq2seq_batch, _hf_loss, unused_parameters=True)


def _seq2seq_batch(rank: int, step: int) -> dict[str, Tensor]:
    g = _generator(rank, step)
    return {
        "input_ids": torch.randint(1, HF_VOCAB, (4, HF_SEQ), generator=g),
        "labels": torch.randint(1, HF_VOCAB, (4, HF_SEQ // 2), generator=g),
    }


def hf_t5() -> Fixture:
    """``T5ForConditionalGeneration`` from a config: one embedding shared by the encoder, the decoder and the tied
    LM head (three uses in three places of the forward), and a relative position bias computed by the first block
    of each stack and passed as a tensor to the next blocks."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=HF_VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(SEED)
    return Fixture(T5ForConditionalGeneration(config), _seq2seq_batch, _hf_loss, mixed_precision=True)


# -- patterns in plain torch ----------------------------------------------------------------------------------------


def _regression_batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    g = _generator(rank, step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _mse_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


class NormThenLinear(nn.Module):
    """A frozen ("pretrained") ``LayerNorm`` followed by a trainable ``Linear`` in the same module, residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        with torch.no_grad():  # not the default ones/zeros, so that a wrong copy of it would show
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.1, 0.1)
        self.norm.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + torch.relu(self.linear(self.norm(x)))
        return out


class FrozenNormStack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(NormThenLinear(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: Tensor = self.head(h)
        return out


def frozen_norm_before_linear() -> Fixture:
    """Three blocks of frozen ``LayerNorm`` -> trainable ``Linear``, between a trainable input and head."""
    torch.manual_seed(SEED)
    return Fixture(FrozenNormStack(), _regression_batch, _mse_loss)


class ReentrantCheckpointed(nn.Module):
    """Runs a block under reentrant activation checkpointing: its backward is a nested backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)
        return out


def reentrant_checkpointing() -> Fixture:
    """``frozen_norm_before_linear`` with every block under reentrant activation checkpointing."""
    fixture = frozen_norm_before_linear()
    stack = fixture.model
    assert isinstance(stack, FrozenNormStack)
    stack.blocks = nn.ModuleList(ReentrantCheckpointed(block) for block in stack.blocks)
    return fixture


class Expert(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down(torch.relu(self.up(x)))
        return out


class TopOneMoE(nn.Module):
    """4 experts, top-1 routing by a learned linear router on the raw input; the expert output is scaled by its
    router probability so that the router is trained. Experts that no token of a batch picks are not called."""

    def __init__(
        self, features: int = 16, width: int = 16, hidden: int = 32, experts: int = 4, container: str = "experts"
    ) -> None:
        super().__init__()
        self.router = nn.Linear(features, experts)
        self.inp = nn.Linear(features, width)
        self.container = container
        self.add_module(container, nn.ModuleList(Expert(width, hidden) for _ in range(experts)))
        self.head = nn.Linear(width, 4)
        with torch.no_grad():
            # Feature 0 (the rank's "domain", +-4) picks experts {0, 1} or {2, 3}; feature 1 picks within the pair.
            self.router.weight.mul_(0.05)
            self.router.weight[:, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0])
            self.router.weight[:, 1] = torch.tensor([1.0, -1.0, 1.0, -1.0])
            self.router.bias.zero_()
        self.last_routing: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        probs = torch.softmax(self.router(x), dim=-1)
        choice = probs.argmax(dim=-1)
        self.last_routing = choice.detach()
        h = self.inp(x)
        mixed = torch.zeros_like(h)
        for index, expert in enumerate(self.get_submodule(self.container)):
            rows = (choice == index).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            mixed = mixed.index_add(0, rows, probs[rows, index, None] * expert(h[rows]))
        out: Tensor = self.head(h + mixed)
        return out


def _moe_batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    g = _generator(rank, step)
    x = torch.randn(4, 16, generator=g)
    x[:, 0] = 4.0 if rank % 2 == 0 else -4.0  # rank 0 routes to experts 0/1, rank 1 to experts 2/3
    x[:, 1] *= 3.0
    return x, torch.randn(4, 4, generator=g)


def moe() -> Fixture:
    """Top-1 mixture of 4 experts. Rank 0's data goes to experts 0/1 and rank 1's to experts 2/3, and with 4 rows
    per batch a rank sometimes uses only one of its pair: every step some expert has no gradient on some rank, and
    in some steps an expert has none on any rank (``moe_routing`` lists them)."""
    torch.manual_seed(SEED)
    return Fixture(TopOneMoE(), _moe_batch, _mse_loss, unused_parameters=True)


def moe_routing(rank: int, steps: int, builder: str = "moe") -> list[list[int]]:
    """The experts each step's batch of ``rank`` is routed to by the initial router (for test assertions)."""
    fixture = BUILDERS[builder]()
    model = fixture.model
    with torch.no_grad():
        out = []
        for step in range(steps):
            model(fixture.batch(rank, step)[0])
            assert isinstance(model, TopOneMoE)
            assert model.last_routing is not None
            out.append(sorted(set(model.last_routing.tolist())))
    return out


# The experts each of the 4 rows of a batch is routed to, per step, for ranks 0 and 1 (``moe_shifting``).
_SHIFTING_ROUTES: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((0, 1, 0, 1), (1, 0, 1, 0)),  # both ranks call experts 0 and 1: nothing looks data-dependent in step 1
    ((0, 0, 0, 0), (1, 2, 1, 2)),  # the ranks part ways; expert 3 unused everywhere
    ((3, 2, 3, 2), (0, 0, 0, 0)),  # rank 0 calls experts 2 and 3, which no rank called in step 1
    ((1, 2, 3, 1), (3, 3, 3, 3)),
    ((2, 2, 2, 2), (0, 1, 2, 3)),
    ((0, 3, 0, 3), (2, 2, 2, 2)),  # expert 1 unused everywhere
)
# TopOneMoE's router reads feature 0 (+: experts 0/1, -: 2/3) and feature 1 (+: experts 0/2, -: 1/3).
_ROUTE_SIGNS = {0: (1.0, 1.0), 1: (1.0, -1.0), 2: (-1.0, 1.0), 3: (-1.0, -1.0)}


def _shifting_batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    g = _generator(rank, step)
    x = torch.randn(4, 16, generator=g)
    for row, expert in enumerate(_SHIFTING_ROUTES[step % len(_SHIFTING_ROUTES)][rank % 2]):
        x[row, 0], x[row, 1] = 4.0 * _ROUTE_SIGNS[expert][0], 3.0 * _ROUTE_SIGNS[expert][1]
    return x, torch.randn(4, 4, generator=g)


def moe_shifting() -> Fixture:
    """``TopOneMoE`` whose routing changes from step to step and rank to rank (``_SHIFTING_ROUTES``): in the first
    step both ranks call the same experts, later each calls experts it did not call then, and experts the other
    rank skips. What a rank routes to is fixed by its data (``moe_routing`` reads it back)."""
    torch.manual_seed(SEED)
    return Fixture(TopOneMoE(), _shifting_batch, _mse_loss, unused_parameters=True)


class RoutedBranches(TopOneMoE):
    """``TopOneMoE`` with its experts registered as ``branches``: a mixture the automatic leaf rule does not
    recognize (Note [leaf modules]), for ``ZeroConfig.leaf_module_classes``."""

    def __init__(self) -> None:
        super().__init__(container="branches")


def routed_branches() -> Fixture:
    """``RoutedBranches`` routed as ``moe_shifting``: the same experts on both ranks in the first step, then not."""
    torch.manual_seed(SEED)
    return Fixture(RoutedBranches(), _shifting_batch, _mse_loss, unused_parameters=True)


class SpareHeadModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.spare_head = nn.Linear(32, 4)  # trainable, never called in forward

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.body(x))
        return out


def unused_head() -> Fixture:
    """An MLP with a second head that forward never uses: its parameters never get a gradient."""
    torch.manual_seed(SEED)
    return Fixture(SpareHeadModel(), _regression_batch, _mse_loss, unused_parameters=True)


def batchnorm_mlp() -> Fixture:
    """Linear -> BatchNorm1d -> ReLU, twice, then a head: running statistics are buffers updated every forward."""
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 4),
    )
    return Fixture(model, _regression_batch, _mse_loss)


ENC_VOCAB = 64
ENC_SEQ = 16


class EncoderWithPositionalEncoding(nn.Module):
    """Embedding + sinusoidal positional encoding (an fp32 buffer) -> LayerNorm -> ``nn.TransformerEncoder``."""

    def __init__(self, width: int = 32, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(ENC_VOCAB, width)
        position = torch.arange(max_len, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10_000.0) / width))
        pe = torch.zeros(max_len, width, dtype=torch.float32)
        pe[:, 0::2] = torch.sin(position * freq)
        pe[:, 1::2] = torch.cos(position * freq)
        self.register_buffer("pe", pe)
        self.norm = nn.LayerNorm(width)
        layer = nn.TransformerEncoderLayer(width, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, ENC_VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.norm(self.embed(tokens) + self.pe[: tokens.size(1)])
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
        out: Tensor = self.head(self.encoder(h, mask=mask, is_causal=True))
        return out


def _encoder_batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, ENC_VOCAB, (4, ENC_SEQ + 1), generator=_generator(rank, step))
    return tokens[:, :-1], tokens[:, 1:]


def _next_token_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def transformer_encoder_with_pe() -> Fixture:
    """A stock ``nn.TransformerEncoder`` LM whose fp32 positional-encoding buffer is added before a LayerNorm."""
    torch.manual_seed(SEED)
    return Fixture(EncoderWithPositionalEncoding(), _encoder_batch, _next_token_loss, mixed_precision=True)


# -- Lightning's demos -----------------------------------------------------------------------------------------------

DEMO_VOCAB = 64


def _demo_batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, DEMO_VOCAB, (4, ENC_SEQ + 1), generator=_generator(rank, step))
    return tokens[:, :-1], tokens[:, 1:]


def _demo_transformer_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    inputs, target = batch  # as ``LightningTransformer.training_step``: log-probabilities in, NLL out
    return nn.functional.nll_loss(model(inputs, target).float(), target.reshape(-1))


def lightning_transformer() -> Fixture:
    """``lightning.pytorch.demos.Transformer``: stock ``nn.Transformer`` (encoder and decoder, initialized by its
    ``_reset_parameters``), one embedding read by both, a positional table built lazily in forward."""
    from lightning.pytorch.demos import Transformer

    torch.manual_seed(SEED)
    model = Transformer(vocab_size=DEMO_VOCAB, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)
    return Fixture(model, _demo_batch, _demo_transformer_loss, mixed_precision=True)


def _demo_lstm_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    inputs, target = batch
    hidden = model.init_hidden(inputs.size(0))  # type: ignore[operator]
    output, _ = model(inputs, hidden)
    return nn.functional.nll_loss(output.float(), target.reshape(-1))


def lightning_lstm() -> Fixture:
    """``lightning.pytorch.demos.lstm.SimpleLSTM``: a stacked ``nn.LSTM`` (cuDNN-style flat weights) between an
    embedding and a decoder the model initializes itself; the initial state is built from its first parameter."""
    from lightning.pytorch.demos.lstm import SimpleLSTM

    torch.manual_seed(SEED)
    model = SimpleLSTM(vocab_size=DEMO_VOCAB, ninp=32, nhid=32, nlayers=2, dropout=0.0)
    return Fixture(model, _demo_batch, _demo_lstm_loss, mixed_precision=True)


@dataclass
class BlockOutput:
    """A plain dataclass (not a registered pytree node, not a ``ModelOutput``) holding the block's hidden state."""

    hidden: Tensor


class DataclassBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> BlockOutput:
        return BlockOutput(hidden=x + self.down(torch.relu(self.up(self.norm(x)))))


class DataclassModel(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(DataclassBlock(width) for _ in range(2))
        self.head = nn.Linear(width, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h).hidden
        out: Tensor = self.head(h)
        return out


def dataclass_output() -> Fixture:
    """Two blocks whose forward returns a ``@dataclass`` with the hidden tensor inside."""
    torch.manual_seed(SEED)
    return Fixture(DataclassModel(), _regression_batch, _mse_loss)


class CompiledMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
        self.body.compile()  # in place (``nn.Module.compile``): parameter names stay those of the eager model

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.body(x)
        return out


def compiled_mlp() -> Fixture:
    """An MLP whose body runs under ``torch.compile`` (default backend, inductor; the first call compiles)."""
    torch.manual_seed(SEED)
    return Fixture(CompiledMLP(), _regression_batch, _mse_loss)


BUILDERS: dict[str, Callable[[], Fixture]] = {
    f.__name__: f
    for f in (
        hf_causal_lm,
        hf_lora,
        hf_prompt_tuning,
        hf_gpt2,
        hf_t5,
        hf_mixtral,
        hf_switch,
        frozen_norm_before_linear,
        reentrant_checkpointing,
        moe,
        moe_shifting,
        routed_branches,
        unused_head,
        batchnorm_mlp,
        transformer_encoder_with_pe,
        lightning_transformer,
        lightning_lstm,
        dataclass_output,
        compiled_mlp,
    )
}


# -- Lightning ------------------------------------------------------------------------------------------------------


class _Batches(torch.utils.data.Dataset):
    """``steps`` fixed batches for one rank: item ``i`` is ``batch(rank, i)`` (used with ``batch_size=None``)."""

    def __init__(self, batch: Callable[[int, int], Batch], rank: int, steps: int) -> None:
        self.batch, self.rank, self.steps = batch, rank, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> Batch:
        return self.batch(self.rank, index)


class ProbeModule(pl.LightningModule):
    """Trains ``BUILDERS[builder_name]()`` under any strategy and precision.

    ``build_in="init"`` builds the model in ``__init__`` (the same initial weights under every strategy);
    ``"configure_model"`` builds it in ``configure_model`` (on the meta device under stage 3, then initialized by
    each module's ``reset_parameters()``, so custom initializations in a builder are not reproduced). The data
    loader gives each rank its own fixed batches (use ``Trainer(use_distributed_sampler=False)``). The loss is
    computed in whatever precision the strategy's forward context gives and recorded as a float.
    """

    def __init__(
        self,
        builder_name: str,
        optimizer: Optimizer = "adamw",
        build_in: Literal["init", "configure_model"] = "init",
        steps: int = 6,
    ) -> None:
        super().__init__()
        if builder_name not in BUILDERS:
            raise ValueError(f"Unknown builder {builder_name!r}. Expected one of {sorted(BUILDERS)}.")
        self.builder_name = builder_name
        self.optimizer_name = optimizer
        self.steps = steps
        self.model: nn.Module | None = None
        self._batch: Callable[[int, int], Batch] | None = None
        self._loss: Callable[[nn.Module, Batch], Tensor] | None = None
        self.losses: list[float] = []
        if build_in == "init":
            self._build()

    def _build(self) -> None:
        fixture = BUILDERS[self.builder_name]()
        self.model = fixture.model
        self._batch, self._loss = fixture.batch, fixture.loss

    def configure_model(self) -> None:
        if self.model is None:
            self._build()

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        assert self.model is not None
        assert self._loss is not None
        loss = self._loss(self.model, batch)
        self.losses.append(float(loss.detach().float()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        if self.optimizer_name == "plain_sgd":  # stateless: a zero gradient and no gradient give the same step
            return torch.optim.SGD(params, lr=0.05)
        raise ValueError(self.optimizer_name)

    def train_dataloader(self) -> DataLoader:
        assert self._batch is not None
        return DataLoader(_Batches(self._batch, self.global_rank, self.steps), batch_size=None)


def probe_trainer(strategy: Any, precision: str = "32-true", steps: int = 6, devices: int = 2) -> pl.Trainer:
    """2 CPU processes, ``steps`` optimizer steps, each rank on its own data, nothing written to disk."""
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def full_state(trainer: pl.Trainer, model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(parameters, buffers) in full and fp32, on every rank: stage 3 gathers the parameters for the copy."""
    gathered = getattr(trainer.strategy, "gathered_parameters", None)
    with gathered() if gathered is not None else nullcontext():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().float().clone() for n, b in model.named_buffers()}
    return params, buffers


def fit_probe(
    builder_name: str,
    strategy: Any,
    precision: str = "32-true",
    steps: int = 6,
    optimizer: Optimizer = "adamw",
    build_in: Literal["init", "configure_model", "init_module"] = "init",
) -> dict[str, Any]:
    """Fit one fixture; returns this rank's ``losses``, final ``weights`` and ``buffers`` and its ``rank``.
    ``build_in="init_module"`` builds it in ``__init__`` under ``trainer.init_module(empty_init=True)``."""
    trainer = probe_trainer(strategy, precision, steps)
    with trainer.init_module(empty_init=True) if build_in == "init_module" else nullcontext():
        in_init = "init" if build_in == "init_module" else build_in
        module = ProbeModule(builder_name, optimizer=optimizer, build_in=in_init, steps=steps)
    trainer.fit(module)
    assert module.model is not None
    weights, buffers = full_state(trainer, module.model)
    return {"rank": trainer.global_rank, "losses": module.losses, "weights": weights, "buffers": buffers}
