"""Changes made inside ``gathered_parameters(writeback=False)`` are refused at its exit, never silently discarded
(Note [edits discarded at exit] in ``lightning_zero/stage3/outside_step.py``): on 2 gloo ranks under
``Fabric(strategy="zero3")``, with the tests' GPT and with peft's ``merge_and_unload()`` on a LoRA Llama, while
forwards, Hugging Face ``generate`` (its KV cache) and a forward that updates a buffer give no report."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_zero import ZeroFabricStrategy
from lightning_zero.models.gpt import GPT, GPTConfig
from tests.harness import run_distributed

_EDITED = "blocks.0.mlp.fc.weight"


class _Counting(nn.Module):
    """The tests' GPT with a buffer its forward updates in place (as a KV cache or a running statistic does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.gpt = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, tokens: Tensor) -> Tensor:
        self.calls += 1
        out: Tensor = self.gpt(tokens)
        return out


def _fabric() -> Fabric:
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=3, collective_timeout_s=10.0), accelerator="cpu", devices=2)
    fabric.launch()
    return fabric


def _error(body: Any) -> str | None:
    try:
        body()
    except RuntimeError as error:
        return str(error)
    return None


def _edits() -> dict[str, Any]:
    fabric = _fabric()
    rank = fabric.global_rank
    model = fabric.setup_module(_Counting())
    strategy: Any = fabric.strategy
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def weights() -> dict[str, Tensor]:
        with strategy.gathered_parameters():
            return {n: p.detach().clone() for n, p in model.module.gpt.named_parameters()}

    before = weights()

    def forwards() -> None:  # evaluation and sampling inside the context: no parameter changes
        with strategy.gathered_parameters(), torch.no_grad():
            for _ in range(3):
                model(tokens)

    def edit_on_rank_1(how: str) -> None:
        with strategy.gathered_parameters():
            if rank == 1:
                param = model.module.gpt.get_parameter(_EDITED)
                if how == "data":
                    param.data.add_(1.0)  # no version counter moves (Note [edits discarded at exit])
                else:
                    param.data = param.detach() + 1.0  # a new tensor
            if how == "before a forward":
                with torch.no_grad():
                    if rank == 1:
                        model.module.gpt.get_parameter(_EDITED).add_(1.0)
                    model(tokens)  # runs on the held parameters: the edit stays to be seen at exit

    result: dict[str, Any] = {"forwards": _error(forwards), "calls": float(model.module.calls)}
    result["data"] = _error(lambda: edit_on_rank_1("data"))
    result["replaced"] = _error(lambda: edit_on_rank_1("replaced"))
    result["before a forward"] = _error(lambda: edit_on_rank_1("before a forward"))
    after = weights()
    result["kept"] = all(torch.equal(after[n], before[n]) for n in before)

    with torch.no_grad():
        unedited = model(tokens)

    def writeback() -> None:
        with strategy.gathered_parameters(writeback=True), torch.no_grad():
            model.module.gpt.get_parameter(_EDITED).add_(1.0)
            result["inside"] = model(tokens)  # on the edited parameters the context holds

    result["writeback"] = _error(writeback)
    result["landed"] = torch.equal(weights()[_EDITED], before[_EDITED] + 1.0)
    with torch.no_grad():
        after_writeback = model(tokens)
    result["forward inside saw the edit"] = torch.equal(result.pop("inside"), after_writeback)
    result["the edit matters"] = not torch.equal(after_writeback, unedited)

    # rank 0 alone, served by rank 1 waiting in the barrier: no peer at its exit, so it warns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank == 0:
            with strategy.gathered_parameters(), torch.no_grad():
                model.module.gpt.get_parameter(_EDITED).mul_(2.0)
        fabric.barrier()
    result["warned"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    result["served_kept"] = torch.equal(weights()[_EDITED], before[_EDITED] + 1.0)
    return result


def test_an_edit_inside_gathered_parameters_without_writeback_is_refused_on_every_rank_naming_it():
    results = run_distributed(_edits, 2, init_process_group=False, timeout=240)
    for rank, r in enumerate(results):
        assert r["forwards"] is None, r["forwards"]  # forwards and a buffer updated in place: no report
        assert r["calls"] == 3.0
        for how in ("data", "replaced", "before a forward"):
            message = r[how]
            assert message is not None, (rank, how)
            assert "writeback=True" in message, message
            if rank == 1:  # the rank that edited names the parameter
                assert f"'gpt.{_EDITED}'" in message, message
                assert "rank 1" in message, message
            else:
                assert "rank(s) 1" in message, message
                assert _EDITED not in message, message
        assert r["kept"]  # discarded as before, and said so
        assert r["writeback"] is None, r["writeback"]
        assert r["landed"]  # writeback=True keeps the edit
        assert r["forward inside saw the edit"]
        assert r["the edit matters"]
    assert any(f"'gpt.{_EDITED}'" in w and "writeback=True" in w for w in results[0]["warned"]), results[0]["warned"]
    assert not [w for w in results[1]["warned"] if "gathered_parameters" in w], results[1]["warned"]
    assert all(r["served_kept"] for r in results)


def _peft_merge() -> dict[str, Any]:
    from tests import third_party_models

    fabric = _fabric()
    model = fabric.setup_module(third_party_models.hf_lora().model)
    strategy: Any = fabric.strategy
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.SGD(trainable, lr=0.5))
    loss = third_party_models._hf_loss(model, third_party_models._token_batch(fabric.global_rank, 0))
    fabric.backward(loss)
    optimizer.step()  # lora_B is no longer zero: merging changes the base weights
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(0))

    def generate() -> None:  # Hugging Face generate, with its KV cache
        with strategy.gathered_parameters(model.module), torch.no_grad():
            model.module.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)

    def merge() -> None:
        with strategy.gathered_parameters(model.module):
            model.module.merge_and_unload()

    return {"generate": _error(generate), "merge": _error(merge)}


@pytest.mark.timeout(300)
def test_peft_merge_and_unload_inside_gathered_parameters_without_writeback_is_refused():
    results = run_distributed(_peft_merge, 2, init_process_group=False, timeout=240)
    for rank, r in enumerate(results):
        assert r["generate"] is None, r["generate"]
        message = r["merge"]
        assert message is not None
        for part in ("writeback=True", "merge_and_unload", f"rank {rank}", "base_layer.weight"):
            assert part in message, message
