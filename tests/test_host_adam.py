"""The host tier's own step (Note [bucketed host Adam], Note [pinned bytes]): bit for bit torch's fused AdamW and Adam,
with param groups, weight decay, amsgrad, maximize, clipping and unused parameters, state in torch's format that
loads back; and the host memory per parameter of masters, moments and the gradient buffer, counted."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero import ZeroConfig, ZeroOptimizer
from lightning_zero.offload import host_adam, host_copies
from lightning_zero.offload.host_arena import HostArena, huge_pages, zeros_on_huge_pages
from lightning_zero.offload.memory_tiers import MemoryTiers
from tests.harness import run_distributed


class _Net(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32, dtype=dtype)
        self.unused = nn.Linear(4, 4, dtype=dtype)  # no gradient ever: never stepped, as by torch
        self.b = nn.Linear(32, 4, dtype=dtype)
        self.late = False
        """Whether ``unused`` takes part (a parameter whose first gradient comes after other parameters' steps)."""

    def forward(self, x: Tensor) -> Tensor:
        out = self.b(torch.nn.functional.gelu(self.a(x)))
        return out + self.unused(out) if self.late else out


def _train(
    tier: bool,
    copies: bool,
    options: dict[str, Any],
    cls: type[torch.optim.Optimizer],
    parallel: str = "intra_op",
    late_from: int | None = None,
    one_group: bool = False,
    dtype: torch.dtype = torch.float32,
    clips: tuple[tuple[str, float], ...] = (("norm", 0.05),),
) -> dict[str, Any]:
    host_copies.FORCE_COPIES = copies
    try:
        torch.manual_seed(0)
        model = _Net(dtype)
        decay = [p for p in model.parameters() if p.ndim == 2]
        other = [p for p in model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0, "lr": 3e-3}]
        if one_group:  # a bucket's segments back to back in one group: Note [one kernel call per bucket]
            groups = [{"params": list(model.parameters()), "weight_decay": 0.1}]
        optimizer = cls(groups, lr=1e-2, fused=None if tier else True, **options)  # type: ignore[call-arg]
        config = ZeroConfig(stage=2, offload_optimizer="cpu" if tier else "none", bucket_numel=300)
        tiers = MemoryTiers(config, None, io_entries=2) if tier else None
        zero = ZeroOptimizer(model, optimizer, dist.group.WORLD, config, tiers=tiers.for_optimizer() if tiers else None)
        for host_steps in tiers.host_steps if tiers else []:
            host_steps.parallel = parallel  # type: ignore[assignment]
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        losses, norms = [], []
        for i in range(4):
            model.late = late_from is not None and i >= late_from
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.item())
            for kind, bound in clips:  # Note [clips in order]
                if kind == "norm":
                    norms.append(zero.clip_grad_norm_(bound).item())
                else:
                    zero.clip_grad_value_(bound)
            zero.step()
            zero.zero_grad()
        state = zero.state_dict()
        zero.load_state_dict(state)  # the flat moments take the loaded values at the next step
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
        zero.step()
        own = len(tiers.optimizer_tiers[0]._own) if tiers else 0
        if tiers is not None:
            tiers.close()
        return {"losses": losses, "weights": [p.detach().clone() for p in model.parameters()], "own": own,
                "state": zero.state_dict()["state"], "norms": norms}  # fmt: skip
    finally:
        host_copies.FORCE_COPIES = False


def _parallel_runs() -> list[list[dict[str, Any]]]:
    torch.set_num_threads(2)
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        runs.append([_train(True, True, {}, torch.optim.AdamW, p, dtype=dtype) for p in ("intra_op", "buckets")])
    runs[1].append(_train(True, False, {}, torch.optim.AdamW, dtype=torch.bfloat16))  # no copies: no worker buffers
    return runs


@pytest.mark.timeout(60)
def test_host_updates_on_a_worker_per_thread_step_bit_for_bit_as_on_one_worker():
    """Note [host step threads]: ``parallel="buckets"`` steps whole buckets on several workers at once; in bf16-mixed
    each worker converts gradients in its own buffer and rounds the masters into staging, bit for bit as the step
    without the copy path."""
    for per_dtype in run_distributed(_parallel_runs, 2):
        for intra_op, *others in per_dtype:
            for other in others:
                assert other["own"] > 1  # several buckets, stepped by two workers
                assert other["losses"] == intra_op["losses"]
                for a, b in zip(other["weights"], intra_op["weights"], strict=True):
                    assert a.dtype == b.dtype
                    assert torch.equal(a, b)


def _all(cases: list[tuple[dict[str, Any], type[torch.optim.Optimizer]]]) -> list[list[dict[str, Any]]]:
    return [[_train(False, False, o, c), _train(True, False, o, c), _train(True, True, o, c)] for o, c in cases]


@pytest.mark.timeout(60)
def test_host_adam_steps_bit_for_bit_as_torchs_fused_adamw_and_adam_with_its_state_in_torchs_format():
    cases = [({}, torch.optim.AdamW), ({"amsgrad": True, "maximize": True}, torch.optim.AdamW), ({}, torch.optim.Adam)]
    (found,) = run_distributed(_all, 1, cases, timeout=50)
    for (options, cls), (torch_fused, tier, copies) in zip(cases, found, strict=True):
        label = f"{cls.__name__}{options}"
        assert tier["own"] > 0, label  # the host tier's own step ran
        assert copies["own"] > 0, label
        for run in (tier, copies):
            assert run["losses"] == torch_fused["losses"], label
            for mine, theirs in zip(run["weights"], torch_fused["weights"], strict=True):
                assert torch.equal(mine, theirs), label
            assert run["state"].keys() == torch_fused["state"].keys(), label  # the unused layer: no state
            for i, entries in torch_fused["state"].items():
                assert list(run["state"][i]) == list(entries), label  # torch's entries, in torch's order
                for name, value in entries.items():
                    assert value.dtype == run["state"][i][name].dtype, (label, name)
                    assert torch.equal(run["state"][i][name], value), (label, i, name)


def _clipped_runs() -> list[list[dict[str, Any]]]:
    clips = (("norm", 0.05), ("value", 0.001), ("norm", 0.02))  # each clip binds: the clamp cuts the largest
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        modes = ((False, False), (True, False), (True, True))  # without tiers; the host tier; its copy path
        runs.append([_train(t, c, {}, torch.optim.AdamW, dtype=dtype, clips=clips) for t, c in modes])
    return runs


@pytest.mark.timeout(60)
def test_clips_taken_one_after_another_act_on_tiered_gradients_in_order_bit_for_bit_as_without_tiers():
    """Note [clips in order]: a norm clip, a value clip and a second norm clip before each step measure and cut
    what the clips before them left, on the host tier as without tiers (fp32 and bf16 parameters)."""
    (found,) = run_distributed(_clipped_runs, 1, timeout=50)
    for untiered, *tiered in found:
        assert len(untiered["norms"]) == 8
        assert untiered["norms"][1] <= 0.05 * (1 + 1e-5)  # the second clip measures what the first left
        for run in tiered:
            assert run["own"] > 0
            assert run["norms"] == untiered["norms"]
            assert run["losses"] == untiered["losses"]
            for mine, theirs in zip(run["weights"], untiered["weights"], strict=True):
                assert torch.equal(mine, theirs)


def _late_runs() -> list[tuple[list[dict[str, Any]], list[tuple[int, int]]]]:
    found = []
    runs = host_adam._runs
    for late_from in (0, 2):  # every parameter from the start; one whose first gradient comes at the third step
        calls: list[tuple[int, int]] = []  # (segments, tensors of the kernel call) per call that joins them

        def spy(lists: list[list[Tensor]], calls: list[tuple[int, int]] = calls) -> list[list[Tensor]]:
            joined = runs(lists)
            calls.append((len(lists[0]), len(joined[0])))
            return joined

        host_adam._runs = spy
        modes = ((False, False), (True, False), (True, True))  # torch's fused AdamW; the host tier, its copy path
        trained = [_train(t, c, {}, torch.optim.AdamW, late_from=late_from, one_group=True) for t, c in modes]
        found.append((trained, calls))
    host_adam._runs = runs
    return found


@pytest.mark.timeout(60)
def test_one_kernel_call_per_bucket_and_per_segment_when_step_counts_differ_both_bit_for_bit_as_torch():
    """Note [one kernel call per bucket]: with every parameter stepped together, segments joined into runs; with a
    parameter whose first gradient comes at the third step (its step count then behind its neighbours'), one
    tensor per segment."""
    (found,) = run_distributed(_late_runs, 1, timeout=50)
    for (torch_fused, *tiers), _ in found:
        for run in tiers:
            assert run["own"] > 0
            assert run["losses"] == torch_fused["losses"]
            for mine, theirs in zip(run["weights"], torch_fused["weights"], strict=True):
                assert torch.equal(mine, theirs)
            for i, entries in torch_fused["state"].items():
                for name, value in entries.items():
                    assert torch.equal(run["state"][i][name], value), (i, name)
    (_, together), (_, late) = found
    # Back to back: fewer tensors than segments (the 4-element biases end a run: Note [one kernel call per bucket])
    assert all(tensors < segments for segments, tensors in together), together
    assert len(late) < len(together), (late, together)  # the late parameter's count differs: per segment


def _host_bytes_per_parameter(dtype: torch.dtype) -> tuple[float, float]:
    host_copies.FORCE_COPIES = True
    try:
        torch.manual_seed(0)
        # Blocks of uneven sizes, as a GPT's units are: none is a power of two in bytes.
        model = nn.Sequential(*[nn.Linear(300 + 7 * i, 307 + 7 * i, dtype=dtype) for i in range(6)])
        config = ZeroConfig(stage=2, offload_optimizer="cpu", bucket_numel=150_000)
        tiers = MemoryTiers(config, None, io_entries=2)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
        zero = ZeroOptimizer(model, adamw, dist.group.WORLD, config, tiers=tiers.for_optimizer())
        for _ in range(2):
            model(torch.randn(4, 300, dtype=dtype)).float().square().mean().backward()
            zero.step()
            zero.zero_grad()
        host = tiers.optimizer_tiers[0].host
        assert host is not None
        moments = {id(t.untyped_storage()): t.untyped_storage().nbytes() for s in adamw.state.values()
                   for t in s.values() if t.dim()}  # fmt: skip
        parameters = sum(p.numel() for p in model.parameters())
        tiers.close()
        return (host.nbytes() + sum(moments.values())) / parameters, host.arena.used_bytes / host.nbytes()
    finally:
        host_copies.FORCE_COPIES = False


def _both() -> list[tuple[float, float]]:
    return [_host_bytes_per_parameter(torch.float32), _host_bytes_per_parameter(torch.bfloat16)]


@pytest.mark.timeout(60)
def test_host_tier_holds_at_most_16_bytes_per_parameter_for_masters_moments_and_gradients():
    """Note [pinned bytes]: fp32 master 4 + Adam's moments 8 + gradient 4 (fp32) or 2 (bf16, whose upload reuses
    the gradient's bytes), counted as the host allocator hands them out."""
    (found,) = run_distributed(_both, 1, timeout=50)
    (fp32, fp32_fill), (bf16, bf16_fill) = found
    assert fp32 <= 16.001, fp32  # and each buffer's 64-byte alignment
    assert bf16 <= 16.0, bf16  # 14, and the edit check's buffer (one bucket here, at most 4M elements)
    assert fp32_fill > 0.99, fp32_fill
    assert bf16_fill > 0.99, bf16_fill


def test_the_arena_hands_out_exact_sizes_from_what_was_reserved():
    arena = HostArena(torch.device("cpu"))
    sizes = [201_000, 100_500] * 10
    arena.reserve([s * 4 for s in sizes])
    tensors = [arena.empty(n, torch.float32) for n in sizes]
    assert [t.numel() for t in tensors] == sizes
    assert len(arena._slabs) == 1
    assert arena.reserved_bytes == arena.used_bytes  # exact: nothing rounded
    tensors.append(arena.empty(1000, torch.bfloat16))  # beyond the reservation: a slab of its own size
    assert arena.reserved_bytes == arena.used_bytes == sum(-(-s * 4 // 64) * 64 for s in sizes) + 2048
    for i, t in enumerate(tensors):  # no overlap
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(tensors))


def test_host_buffers_are_advised_onto_huge_pages_where_the_kernel_allows_it():
    """Note [huge pages]: whole 2 MiB pages inside a buffer only; a buffer smaller than one is left alone."""
    assert not huge_pages(torch.empty(1000))  # no whole 2 MiB page inside
    big = zeros_on_huge_pages(3 << 20, torch.float32)  # 12 MiB: at least five whole huge pages
    assert torch.equal(big, torch.zeros_like(big))
    if not huge_pages(big):
        pytest.skip("this kernel takes no MADV_HUGEPAGE advice (not Linux, or transparent huge pages off)")
    written = torch.ones(3 << 20)
    huge_pages(written, collapse=True)  # a hint: taken or not, the values stay
    assert bool((written == 1).all())
