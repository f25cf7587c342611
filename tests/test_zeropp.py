"""ZeRO++: block quantization, the node topology, qwZ's quantized all-gather, hpZ's secondary shards (exact parity
with plain stage 3, no inter-node bytes in backward gathers), qgZ's hierarchical reduce-scatter, and the config."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zero import ZeroConfig
from lightning_zero.cli.estimate import main as estimate_main
from lightning_zero.cli.estimate_zeropp import stage3_link_bytes, zeropp_link_bytes
from lightning_zero.comm.quantization import PackedLayout, dequantize_rows, max_error, quantize_rows
from lightning_zero.comm.topology import NodeTopology, ranks_per_node_from_environment
from tests import zeropp_runs
from tests.harness import run_distributed

# -- block quantization (no process group) ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("numel", "block"), [(1000, 64), (1001, 7), (5, 8), (4096, 2048), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_dequantize_error_is_within_half_a_block_scale(bits, numel, block, dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, numel) * torch.tensor([[1e-3], [1.0], [1e3]])).to(dtype)
    x[1, : min(numel, block)] = 0  # a block of zeros has scale 0 and comes back as zeros
    packed = quantize_rows(x, block, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, PackedLayout(numel, block, bits).row_bytes)
    back = dequantize_rows(packed, numel, block, bits, torch.float32)
    error = (back - x.float()).abs()
    bound = max_error(x.float(), block, bits)
    fp32_rounding = x.float().abs() * 2**-22  # of x / scale and q * scale
    assert (error <= bound + fp32_rounding).all(), float((error - bound).max())
    assert (back[1, : min(numel, block)] == 0).all()


def test_int4_packs_two_codes_per_byte_and_int8_one():
    int8 = PackedLayout(4096, 2048, 8)
    int4 = PackedLayout(4096, 2048, 4)
    assert int8.code_bytes == 4096
    assert int4.code_bytes == 2048
    assert int8.scale_bytes == int4.scale_bytes == 2 * 4
    assert int8.row_bytes % 4 == 0
    assert int4.row_bytes % 4 == 0


def test_quantization_is_exact_on_values_of_the_grid():
    scale = 0.5
    codes = torch.arange(-7, 8, dtype=torch.float32)
    x = (codes * scale).view(1, -1)  # amax = 7 * scale: every element is a code of the int4 grid
    assert torch.equal(dequantize_rows(quantize_rows(x, 16, 4), 15, 16, 4, torch.float32), x)


# -- topology (no process group) -------------------------------------------------------------------------------------


def test_topology_places_consecutive_ranks_on_a_node():
    topology = NodeTopology(8, 4)
    assert topology.num_nodes == 2
    assert [topology.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topology.link(1, 3) == "intra_node"
    assert topology.link(3, 4) == "inter_node"
    assert topology.node_ranks(1) == [4, 5, 6, 7]


def test_topology_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match=r"ranks_per_node: 3 for a world of 4 ranks.*divisor.*HINT"):
        NodeTopology(4, 3)


def test_ranks_per_node_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    assert ranks_per_node_from_environment() is None
    assert NodeTopology.resolve(4, None).ranks_per_node == 4  # unknown: one node
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x3)")
    assert ranks_per_node_from_environment() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's wins
    assert NodeTopology.resolve(8, None).ranks_per_node == 4
    assert NodeTopology.resolve(8, 2).ranks_per_node == 2  # the config overrides the environment


# -- config ----------------------------------------------------------------------------------------------------------


def test_zeropp_is_off_by_default():
    config = ZeroConfig(stage=3)
    assert not config.uses_zeropp
    assert (config.quantize_weights, config.quantize_gradients, config.hpz_partition_size) == (False, False, 1)


@pytest.mark.parametrize(
    "switch", [{"quantize_weights": True}, {"quantize_gradients": True}, {"hpz_partition_size": 2}]
)
@pytest.mark.parametrize("stage", [1, 2])
def test_zeropp_below_stage_3_is_refused(switch, stage):
    with pytest.raises(ValueError, match=rf"{next(iter(switch))}=.* with stage={stage}.*HINT: set stage=3"):
        ZeroConfig(stage=stage, **switch)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("ranks_per_node", 0, "positive integer"),
        ("hpz_partition_size", 0, "positive integer"),
        ("quantization_block", -8, "positive integer"),
        ("quantize_weights", "yes", "True or False"),
        ("quantize_gradients", 1, "True or False"),
        ("gradient_quantization_bits", 2, "Expected 4 or 8"),
    ],
)
def test_zeropp_fields_are_validated(field, value, error):
    with pytest.raises((ValueError, TypeError), match=rf"ZeroConfig\.{field}: {value!r}\..*{error}"):
        ZeroConfig(stage=3, **{field: value})


def test_hpz_partition_must_stay_inside_a_node():
    with pytest.raises(ValueError, match=r"hpz_partition_size: 4 with ranks_per_node=2.*divisor"):
        ZeroConfig(stage=3, ranks_per_node=2, hpz_partition_size=4)


# -- collectives on 4 ranks (2 nodes x 2) ----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_quantized_all_gather_matches_the_exact_gather_within_the_bound():
    shard, block = 1000, 64
    results = run_distributed(zeropp_runs.quantized_gather, 4, shard, block)
    exact = results[0]["exact"]
    bound = max_error(exact.view(4, shard), block, 8).reshape(-1)
    for result in results:
        assert torch.equal(result["exact"], exact)
        assert torch.equal(result["quantized"], results[0]["quantized"]), "every rank sees the same weights"
        error = (result["quantized"] - exact).abs()
        assert (error <= bound + exact.abs() * 2**-22).all()
        assert error.max() > 0  # it did quantize


def _hierarchical_bound(inputs: list[torch.Tensor], shard: int, block: int, bits: int) -> torch.Tensor:
    """(world, shard): the bound on |hierarchical - exact average| per element (Note [hierarchical
    reduce-scatter]): each hop's half block scale, summed over what it adds, divided by the world size."""
    world, k = len(inputs), zeropp_runs.RANKS_PER_NODE
    n = world // k
    rows = [x.float().view(n, k, shard).transpose(0, 1).reshape(k, n * shard) for x in inputs]
    first = [max_error(r, block, bits).view(k, n, shard) for r in rows]  # [source](position, node, S)
    bound = torch.zeros(world, shard)
    for node in range(n):
        sources = range(node * k, (node + 1) * k)
        partial = sum(rows[i].view(k, n, shard) for i in sources)  # exact node sums, (position, node, S)
        err1 = sum(first[i] for i in sources)
        for position in range(k):
            worst = (partial[position].abs() + err1[position]).view(n, shard)  # |dequantized partial| <= this
            err2 = max_error(worst, block, bits)  # (node, S) rows as quantized in hop 2
            for m in range(n):
                bound[m * k + position] += err1[position, m] + err2[m]
    return bound / world


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bits", [8, 4])
def test_hierarchical_reduce_equals_the_exact_average_within_the_bound(bits):
    shard, block = 512, 128
    results = run_distributed(zeropp_runs.hierarchical_reduce, 4, shard, block, bits)
    bound = _hierarchical_bound([r["input"] for r in results], shard, block, bits)
    for rank, result in enumerate(results):
        error = (result["hierarchical"].float() - result["exact"]).abs()
        bf16_rounding = result["exact"].abs() * 2**-8  # the bf16 output
        assert (error <= bound[rank] + bf16_rounding + 1e-7).all(), float((error - bound[rank]).max())
        # One quantized chunk of the shard crosses nodes; a bf16 reduce-scatter sends two chunks there.
        exact_inter = 2 * shard * 2
        assert 0 < result["inter"]["reduce_scatter"] < exact_inter * (0.3 if bits == 4 else 0.6)


# -- stage-3 training on 4 ranks (2 nodes x 2) -----------------------------------------------------------------------

PLAIN = ZeroConfig(stage=3, ranks_per_node=2)
HPZ = ZeroConfig(stage=3, ranks_per_node=2, hpz_partition_size=2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("native", [False, True], ids=["gloo-forms", "native-collectives"])
def test_hpz_matches_plain_stage3_bit_for_bit_with_no_inter_node_bytes_in_backward_gathers(native):
    steps = 4
    plain = run_distributed(zeropp_runs.train_metered, 4, PLAIN, steps, native)
    hpz = run_distributed(zeropp_runs.train_metered, 4, HPZ, steps, native)
    for reference, candidate in zip(plain, hpz, strict=True):
        assert candidate["losses"] == reference["losses"]
        for name, weight in reference["weights"].items():
            assert torch.equal(candidate["weights"][name], weight), name
        for step in range(steps):
            assert reference["backward_gathers"][step]["inter_node"] > 0  # plain stage 3 crosses nodes
            assert candidate["backward_gathers"][step]["inter_node"] == 0
            assert candidate["backward_gathers"][step]["intra_node"] > 0
        # Forward gathers still cross nodes: half of plain's all-gather traffic there.
        plain_inter = reference["links"][-1]["inter_node"]["all_gather"]
        assert candidate["links"][-1]["inter_node"]["all_gather"] == plain_inter // 2


@pytest.mark.timeout(180)
def test_qwz_and_qgz_train_close_to_plain_with_less_inter_node_traffic():
    steps = 6
    plain = run_distributed(zeropp_runs.train_metered, 4, PLAIN, steps)
    everything = ZeroConfig(
        stage=3,
        ranks_per_node=2,
        hpz_partition_size=2,
        quantize_weights=True,
        quantize_gradients=True,
        quantization_block=64,
        gradient_quantization_bits=8,
    )
    zeropp = run_distributed(zeropp_runs.train_metered, 4, everything, steps)
    for reference, candidate in zip(plain, zeropp, strict=True):
        losses, expected = torch.tensor(candidate["losses"]), torch.tensor(reference["losses"])
        assert torch.isfinite(losses).all()
        torch.testing.assert_close(losses, expected, rtol=0.02, atol=0.0)
        assert candidate["losses"] != reference["losses"]  # quantization did change something
        inter = sum(candidate["links"][-1]["inter_node"].values())
        assert inter <= 0.3 * sum(reference["links"][-1]["inter_node"].values())


@pytest.mark.timeout(120)
def test_trainer_with_every_zeropp_switch_sends_a_quarter_of_plain_stage3_across_nodes(tmp_path):
    # The example GPT (tiny here; benchmarks/zeropp_gpt.py runs the small one for 300 steps), bf16-mixed, 4 ranks
    # as 2 nodes x 2. The tiny model's shards are a few thousand elements: smaller blocks keep the padding of each
    # shard to whole blocks small.
    plain = {"ranks_per_node": 2}
    zeropp = {**plain, "quantize_weights": True, "hpz_partition_size": 2, "quantize_gradients": True}
    zeropp["quantization_block"] = 256
    runs = run_distributed(
        zeropp_runs.fit_gpt_pair, 4, [plain, zeropp], 3, str(tmp_path), "tiny", init_process_group=False, timeout=110
    )
    for reference, candidate in runs:
        assert all(math.isfinite(loss) for loss in candidate["losses"])
        for step in (1, 2):  # the first step's gathers are rounds (Note [data-dependent units])
            inter, plain_inter = candidate["sent"][step]["inter_node"], reference["sent"][step]["inter_node"]
            assert 0 < inter <= 0.25 * plain_inter
            assert candidate["sent"][step]["intra_node"] > 0
        assert candidate["model_state"]["secondary_shards"] == candidate["model_state"]["parameters"] * 4 // 2
        assert reference["model_state"]["secondary_shards"] == 0


@pytest.mark.timeout(120)
def test_a_zeropp_checkpoint_holds_the_exact_state_and_loads_into_plain_stage3(tmp_path):
    zeropp = {"ranks_per_node": 2, "quantize_weights": True, "hpz_partition_size": 2, "quantize_gradients": True}
    for saved, loaded, loss in run_distributed(
        zeropp_runs.checkpoint_into_plain, 4, zeropp, str(tmp_path), init_process_group=False, timeout=110
    ):
        assert len(saved) == len(loaded) > 0
        for before, after in zip(saved, loaded, strict=True):
            assert torch.equal(before, after)
        assert math.isfinite(loss)


# -- estimate --------------------------------------------------------------------------------------------------------


def test_estimate_formulas_put_no_backward_bytes_across_nodes_and_a_fraction_of_the_rest():
    psi, world, per_node = 10**9, 64, 8
    plain = stage3_link_bytes(psi, world, per_node, 2)
    zeropp = zeropp_link_bytes(psi, world, per_node, 2, 2048, 4)
    assert sum(r.intra_node + r.inter_node for r in plain) == pytest.approx(3 * psi * 2 * (world - 1) / world)
    assert zeropp[1].inter_node == 0  # hpZ
    assert zeropp[0].inter_node == pytest.approx(plain[0].inter_node / 2, rel=0.01)  # int8 vs bf16, + scales
    assert zeropp[2].inter_node < plain[2].inter_node / 4  # int4, and only 1/R of the chunks cross
    assert sum(r.inter_node for r in zeropp) <= 0.25 * sum(r.inter_node for r in plain)


def test_estimate_prints_zeropp_with_hpz_memory_and_refuses_a_topology_that_does_not_divide(capsys):
    assert estimate_main(["--params", "1e9", "--gpus", "16", "--ranks-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO++ at stage 3 with 4 ranks per node (4 nodes)" in out
    assert "hpZ's secondary shards: 0.500 GB per rank" in out  # 2 bytes x 1e9 / 4
    assert estimate_main(["--params", "1e9", "--gpus", "16", "--ranks-per-node", "3"]) == 2
    assert "--ranks-per-node: 3 for N = 16" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_gathered_parameters_under_qwz_are_the_exact_shards_and_writeback_keeps_them():
    # qwZ rounds the forward gathers to int8 blocks; weights handed to the user (export, sampling, EMA) and written
    # back from there must be the shards' own values, or an unchanged writeback would round every weight.
    config = ZeroConfig(stage=3, quantize_weights=True, quantization_block=64)
    for result in run_distributed(zeropp_runs.gathered_under_qwz, 2, config):
        assert result["seen"]
        assert len(result["seen"]) == len(result["exact"])
        for seen, exact in zip(result["seen"], result["exact"], strict=True):
            assert torch.equal(seen, exact)
        for before, after in zip(result["before"], result["after"], strict=True):
            assert torch.equal(before, after)
