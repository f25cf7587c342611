"""Stage-3 sharded initialization of models built on the meta device that do not initialize themselves through
``reset_parameters()``: Hugging Face models and peft adapters (Notes [Hugging Face initialization] and [peft adapters
on meta] in ``stage3/library_init.py``), and initializers that forget a parameter (Note [meta buffers])."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero import ZeroConfig, shard_module
from lightning_zero.stage3.sharded_init import move_materialized
from tests.harness import DistributedTestError, run_distributed

CPU = torch.device("cpu")


def _hugging_face_model(name: str) -> nn.Module:
    """The model of a ``tests/third_party_models.py`` fixture (seeded inside the builder), on the current device."""
    from tests.third_party_models import BUILDERS

    return BUILDERS[name]().model


def _built_on_meta_and_directly(name: str) -> tuple[dict[str, Tensor], dict[str, Tensor], list[str]]:
    """(sharded init on meta, direct construction): every parameter and buffer, gathered; and the unit names."""
    direct = _hugging_face_model(name)
    reference = {**dict(direct.named_parameters()), **dict(direct.named_buffers())}
    with torch.device("meta"):
        model = _hugging_face_model(name)
    gatherer = shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU)
    with gatherer.gathered():
        sharded = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return sharded, reference, [u.name for u in gatherer.units]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["hf_causal_lm", "hf_gpt2", "hf_t5", "hf_lora", "lightning_transformer"])
def test_model_built_on_meta_is_initialized_as_its_library_initializes_it(name):
    """Constant tensors (norm weights, biases, rotary frequencies, LoRA's ``lora_B`` zeros, attention biases) equal a
    directly built model's exactly; random ones have its spread, layer by layer: the model's own scheme (T5's
    per-projection scales, GPT-2's scaled ``c_proj``, 0.02 elsewhere, also for the base layers peft wraps;
    ``nn.Transformer``'s Xavier on every matrix), not torch's defaults (a 32-wide ``nn.Linear`` draws with std
    0.10)."""
    for sharded, reference, units in run_distributed(_built_on_meta_and_directly, 2, name):
        assert len(units) > 1, units  # really sharded unit by unit
        assert sharded.keys() == reference.keys()
        constant = random = 0
        for key, expected in reference.items():
            value = sharded[key]
            assert value.shape == expected.shape, key
            assert torch.isfinite(value.float()).all(), key
            if expected.numel() == 1 or bool((expected == expected.flatten()[0]).all()):
                torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=key)
                constant += 1
            elif expected.dtype.is_floating_point and key.endswith("weight") and expected.numel() >= 256:
                ratio = value.float().std().item() / expected.float().std().item()
                assert 0.8 < ratio < 1.25, (key, ratio, expected.std().item())
                assert abs(value.float().mean().item()) < 4 * expected.float().std().item() / math.sqrt(256), key
                random += 1
            elif "freq" in key:  # a computed buffer (rotary frequencies): computed the same way
                torch.testing.assert_close(value, expected, msg=key)
        assert constant > 0
        assert random > 0


class ForgetsOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.forgotten = nn.Parameter(torch.empty(4))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _shard(model_factory: Any) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), model_factory())
    shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU)


@pytest.mark.timeout(60)
def test_a_parameter_the_initializer_does_not_set_is_refused_naming_it():
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_shard, 2, ForgetsOne)
    message = str(error.value)
    assert "'1.forgotten'" in message
    assert "ForgetsOne" in message
    assert "training would start from uninitialized memory" in message
    assert "HINT: initialize them in ForgetsOne.reset_parameters()" in message
    assert "reset_parameters()" in message


def _fit_built_in_configure_model(name: str) -> list[float]:
    import lightning_zero  # noqa: F401  (registers "zero3")
    from tests.third_party_models import fit_probe

    return list(fit_probe(name, "zero3", build_in="configure_model")["losses"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "vocabulary"),
    [("hf_causal_lm", 96), ("hf_lora", 96), ("lightning_transformer", 64), ("lightning_lstm", 64)],
)
def test_third_party_model_built_in_configure_model_trains_under_stage_3(name, vocabulary):
    """The Lightning path: ``configure_model`` builds on meta ``LlamaForCausalLM`` (its RMSNorms have no
    ``reset_parameters()``), it under peft LoRA (a frozen base, adapters starting at zero), or Lightning's demo
    Transformer and LSTM (an ``nn.LSTM`` with weak references to its weights); the first loss is that of an
    initialized model, ln(vocabulary) within 0.1 (the LSTM's embedding loses its demo-specific init but not its
    scale there), and every step's loss is finite."""
    for losses in run_distributed(_fit_built_in_configure_model, 2, name, init_process_group=False):
        assert len(losses) == 6
        assert all(math.isfinite(loss) for loss in losses)
        assert abs(losses[0] - math.log(vocabulary)) < 0.1, losses


def _shard_gpt2_finely() -> None:
    with torch.device("meta"):
        model = _hugging_face_model("hf_gpt2")
    config = ZeroConfig(stage=3, wrap_module_classes=(), wrap_min_numel=1000)  # units inside the attention
    shard_module(model, config, dist.group.WORLD, CPU)


@pytest.mark.timeout(60)
def test_units_finer_than_a_hugging_face_initialization_are_refused_with_the_fix():
    """GPT-2's attention rescales its child ``c_proj`` in ``_init_weights``; a unit made of ``c_proj`` alone is
    sharded before that runs, and the error says so instead of torch's message about overlapping memory alone."""
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_shard_gpt2_finely, 2)
    message = str(error.value)
    assert "initialization (_init_weights) of GPT2Attention failed" in message
    assert "wrap_module_classes" in message
    assert "param_init_fn" in message


def _lora_on_meta(options: dict[str, Any]) -> dict[str, Tensor]:
    """The fixtures' Llama under LoRA (``LoraConfig(**options)``), built on meta: every adapter tensor."""
    from peft import LoraConfig, get_peft_model

    from tests.third_party_models import _llama

    with torch.device("meta"):
        model = get_peft_model(_llama(), LoraConfig(r=4, **options))
    gatherer = shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU)
    with gatherer.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _std(adapters: dict[str, Tensor], kind: str) -> float:
    return float(torch.cat([t.flatten() for n, t in adapters.items() if f".{kind}." in n]).std())


KAIMING_STD = 1 / math.sqrt(3 * 32)  # nn.Linear's default on 32 inputs: U(±1/sqrt(32))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("init", "expected_std"),
    [
        # lora_A, lora_B, and an embedding's lora_embedding_A, lora_embedding_B
        (True, {"lora_A": KAIMING_STD, "lora_B": 0.0, "lora_embedding_A": 0.0, "lora_embedding_B": 1.0}),
        ("gaussian", {"lora_A": 1 / 4, "lora_B": 0.0, "lora_embedding_A": 0.0, "lora_embedding_B": 1.0}),
        (
            False,
            {"lora_A": KAIMING_STD, "lora_B": 1 / math.sqrt(3 * 4), "lora_embedding_A": 1.0, "lora_embedding_B": 1.0},
        ),
    ],
)
def test_lora_adapters_built_on_meta_get_the_init_lora_weights_of_their_config(init, expected_std):
    """Each ``init_lora_weights`` as peft's constructor gives it: ``lora_B`` zero unless ``False`` (then torch's
    default on its 4 inputs), ``lora_A`` torch's default or std 1/r (``"gaussian"``), an embedding's adapters
    ``torch.randn`` with A zeroed unless ``False``."""
    options = {"target_modules": ["q_proj", "v_proj", "embed_tokens"], "init_lora_weights": init}
    for adapters in run_distributed(_lora_on_meta, 2, options):
        assert len(adapters) == 2 * 4 + 2
        for kind, std in expected_std.items():
            if std == 0.0:
                assert all(bool((t == 0).all()) for n, t in adapters.items() if f".{kind}." in n), kind
            else:
                assert 0.8 < _std(adapters, kind) / std < 1.2, (kind, _std(adapters, kind), std)


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        ({"use_dora": True}, "with a LoRA variant (default: DoraLinearVariant"),
        ({"init_lora_weights": "pissa"}, "with init_lora_weights='pissa' for adapter 'default'"),
        ("prompt_tuning", "Embedding 'prompt_encoder.default.embedding', inside peft's PromptEmbedding"),
    ],
)
def test_peft_initialization_that_cannot_be_recreated_on_meta_is_refused_up_front(build, expected):
    """Initializations computed from the base layer's weights (DoRA's magnitude, PiSSA), and peft modules other than
    LoRA layers, are refused with the fix, by the model walk that runs before any memory or collective."""
    from peft import LoraConfig, PromptTuningConfig, TaskType, get_peft_model

    from lightning_zero.stage3.library_init import library_inits
    from tests.third_party_models import _llama

    with torch.device("meta"):
        if build == "prompt_tuning":
            config: Any = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
        else:
            config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **build)
        model = get_peft_model(_llama(), config)
    with pytest.raises(ValueError, match="built on the meta device") as error:
        library_inits(model)
    assert expected in str(error.value)
    assert "HINT: build the model and apply the adapters in `__init__`" in str(error.value)
    assert "`param_init_fn`" in str(error.value)


def _attention_on_meta() -> dict[str, Tensor]:
    if "reset_parameters" in vars(nn.MultiheadAttention):  # ``lightning.pytorch.demos`` adds one when imported
        delattr(nn.MultiheadAttention, "reset_parameters")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 32), nn.MultiheadAttention(32, 2), nn.Linear(32, 4))
    gatherer = shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU)
    with gatherer.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(60)
def test_multihead_attention_built_on_meta_gets_its_constructors_initialization():
    """``nn.MultiheadAttention`` has no ``reset_parameters()``; its constructor's ``_reset_parameters()`` runs after
    its ``out_proj`` exists: Xavier-uniform projections and zero biases, ``out_proj``'s included."""
    for params in run_distributed(_attention_on_meta, 2):
        bound = math.sqrt(6 / (32 + 96))  # xavier_uniform_ of the (96, 32) in_proj_weight
        assert bool((params["1.in_proj_bias"] == 0).all())
        assert bool((params["1.out_proj.bias"] == 0).all())
        weight = params["1.in_proj_weight"]
        assert float(weight.abs().max()) <= bound
        assert 0.9 < float(weight.std()) / (bound / math.sqrt(3)) < 1.1


def _lstm_on_meta() -> tuple[dict[str, Tensor], dict[str, Tensor], bool, list[str]]:
    import warnings

    from tests.third_party_models import lightning_lstm

    direct = lightning_lstm().model.rnn
    with torch.device("meta"):
        model = lightning_lstm().model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gatherer = shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU)
    with gatherer.gathered():
        rnn = model.rnn
        flat = all(w is getattr(rnn, n) for w, n in zip(rnn._flat_weights, rnn._flat_weights_names, strict=True))
        sharded = {n: p.detach().clone() for n, p in rnn.named_parameters()}
    return sharded, dict(direct.named_parameters()), flat, [str(w.message) for w in caught]


@pytest.mark.timeout(60)
def test_lstm_built_on_meta_is_materialized_in_place_and_its_own_init_lost_is_warned_about():
    """``nn.LSTM`` holds weak references to its weights, which ``swap_tensors`` refuses: they are rebuilt, so the
    layer's flat weights are its parameters, initialized as a direct build's (same draws, same order). The demo's
    ``init_weights()`` (run by its ``__init__``) is not re-run on meta, and the warning says so with the fix."""
    for sharded, direct, flat, warned in run_distributed(_lstm_on_meta, 2):
        assert flat
        assert sharded.keys() == direct.keys()
        for key, expected in direct.items():
            torch.testing.assert_close(sharded[key], expected, rtol=0, atol=0, msg=key)
        message = next(w for w in warned if "SimpleLSTM defines init_weights()" in w)
        assert "that initialization is lost" in message
        assert "HINT: pass `param_init_fn`" in message


def test_sharding_moves_what_is_materialized_to_the_device_and_keeps_the_parameter_objects():
    # Note [partly meta models]: a LightningModule's own tensors from __init__ (CPU) beside a network built on meta.
    # The CPU machine has one real device, so the target here is meta: what is not there yet must move, in place.
    root = nn.Module()
    root.scale = nn.Parameter(torch.ones(3))
    root.register_buffer("seen", torch.zeros(()))
    with torch.device("meta"):
        root.net = nn.Linear(2, 2)
    net_weight = root.net.weight
    move_materialized(root, torch.device("meta"))
    assert root.seen.is_meta
    assert not root.scale.is_meta  # parameters move with their unit, as it is sharded (move_unit_parameters)
    assert root.net.weight is net_weight  # already on the target: untouched


def _shard_a_model_built_on_the_cpu(layers: int) -> tuple[int, int, int]:
    """(peak bytes allocated while sharding onto another device, the model's bytes, its largest unit's bytes)."""
    from lightning_zero.engine.model_sharding import shard_for_stage3
    from lightning_zero.models.gpt import GPT, GPTConfig
    from tests.memory_probe import NewStorageBytes

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=layers, n_embd=64, n_head=2, vocab_size=64, block_size=16))  # on the CPU
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    unit = max(sum(p.numel() * p.element_size() for p in block.parameters()) for block in model.blocks)
    # "cpu:0" is another device to the sharding code (tensors moved there are copies), and still the host's memory:
    # every byte moved to, or allocated on, the target is a storage created inside the context.
    with NewStorageBytes() as allocated:
        ranks = SimpleNamespace(process_group=dist.group.WORLD, root_device=torch.device("cpu", 0), num_processes=2)
        shard_for_stage3(model, ZeroConfig(stage=3), ranks, None, None)
    return allocated.peak, full, unit


@pytest.mark.timeout(60)
def test_a_model_built_on_the_cpu_is_moved_to_the_device_unit_by_unit_as_it_is_sharded():
    """FSDP and DeepSpeed move a model built normally (on the CPU, ``from_pretrained``, ``init_module()`` without
    ``empty_init``) unit by unit; moved whole first, a model larger than one device could not be sharded at all."""
    for peak, full, unit in run_distributed(_shard_a_model_built_on_the_cpu, 2, 12, timeout=50):
        # This rank's shards (half the model) and a unit in flight (its parameters moved, then flattened), never
        # the whole model; which the bound excludes with room to spare.
        bound = full // 2 + 3 * unit
        assert bound < 0.9 * full, (bound, full)
        assert peak < bound, (peak, full, unit)
