"""Peak RSS per rank while pretrained weights load into a stage-3 model, against ``from_pretrained`` on every rank.

    .venv/bin/python benchmarks/pretrained_load_rss.py --world-size 4 --out benchmarks/results/pretrained_load_rss.json

A Hugging Face Llama (``--hidden``, ``--layers``, ``--vocab``; fp32, tied head) is written once with
``save_pretrained`` as safetensors shards of ``--max-shard-size``. Then, on ``--world-size`` fresh gloo ranks (spawned,
``MALLOC_MMAP_THRESHOLD_=65536``, so peak RSS follows the tensors alive; ``benchmarks/README.md``):

* ``zero3``: the model is built on the meta device, sharded unit by unit (``shard_module``, stage 3) and wrapped in a
  ``ZeroOptimizer``; then ``load_full_state_dict(model, directory)`` reads, memory-mapped, only the rows holding each
  range the rank owns. Reported: the peak RSS during the load above the RSS just before it (``VmHWM`` after resetting
  it through ``/proc/self/clear_refs``), next to this rank's shard (its parameter bytes) and the full model's bytes.
* ``from_pretrained``: each rank loads the whole model with ``AutoModelForCausalLM.from_pretrained``, the way a DDP
  run starts, and reads every parameter once (transformers may leave them mapped from the files, paged in only when
  first used); the same peak above the RSS before the call.

Then ``zero3`` writes the model back as one full ``torch.save`` file (``save_full_checkpoint``, as
``state_dict_type="full"`` does): the peak above the RSS before it, next to the largest parameter (what rank 0 puts
together at once; here the tied embedding).

The ``zero3`` load peak is about one shard: the pages of the files holding this rank's rows, mapped while they are read,
plus one parameter's rows in flight; the shard itself existed before the load (``shard_module`` allocated it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import _common as bench
import torch
import torch.distributed as dist

MiB = 2**20


def _llama_config(hidden: int, layers: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        tie_word_embeddings=True,
    )


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _load_rank(rank: int, world_size: int, directory: str, mode: str, config: dict[str, int]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from lightning_zero import ZeroConfig, ZeroOptimizer, load_full_state_dict, shard_module
    from lightning_zero.checkpoint.full_save import save_full_checkpoint
    from lightning_zero.checkpoint.sharded_checkpoint import sharded_model_state

    if mode == "from_pretrained":
        before = bench.memory_status()["VmRSS"]
        _reset_peak()
        model = AutoModelForCausalLM.from_pretrained(directory)
        with torch.no_grad():  # its tensors may map the files: read every one once, as the first step does
            for p in model.parameters():
                p.sum()
        peak = bench.memory_status()["VmHWM"]
        shard = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"peak_above_before": peak - before, "shard_bytes": shard, "mmap": bench.mmap_threshold_active()}
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama_config(**config))
    zero = ZeroConfig(stage=3, wrap_module_classes=("LlamaDecoderLayer",))
    gatherer = shard_module(model, zero, dist.group.WORLD, torch.device("cpu"))
    optimizer = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), dist.group.WORLD, zero, gatherer)
    shard = sum(b.param_shard.numel() * b.param_shard.element_size() for b in gatherer.all_buckets())
    dist.barrier()
    before = bench.memory_status()["VmRSS"]
    _reset_peak()
    load_full_state_dict(model, directory, optimizers=[optimizer])
    peak = bench.memory_status()["VmHWM"]
    result = {"peak_above_before": peak - before, "shard_bytes": shard, "mmap": bench.mmap_threshold_active()}
    # The other way: one full torch.save file written from the shards (state_dict_type="full").
    checkpoint = {"state_dict": sharded_model_state(model, [optimizer], gatherer)}
    dist.barrier()
    before = bench.memory_status()["VmRSS"]
    _reset_peak()
    save_full_checkpoint(checkpoint, f"{directory}.full.ckpt", model, [optimizer], dist.group.WORLD, gatherer)
    result["save_peak_above_before"] = bench.memory_status()["VmHWM"] - before
    result["largest_parameter_bytes"] = max(
        s.numel() * 4 for s in (slot.shape for b in gatherer.all_buckets() for slot, _ in b.slots_and_params())
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--max-shard-size", default="50MB")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="pretrained_rss_") as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(_llama_config(**config))
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(tmp, max_shard_size=args.max_shard_size)
        del model
        files = sorted(p.name for p in Path(tmp).glob("*.safetensors"))
        record: dict[str, Any] = {"config": config, "full_bytes": full, "files": files, "world_size": args.world_size}
        print(f"model: {full / MiB:.1f} MiB fp32 in {len(files)} safetensors files; {args.world_size} ranks")
        for mode in ("zero3", "from_pretrained"):
            run = bench.run_ranks(_load_rank, args.world_size, (tmp, mode, config))
            record[mode] = run.results
            assert all(r["mmap"] for r in run.results), "MALLOC_MMAP_THRESHOLD_ did not take effect"
            peaks = ", ".join(f"{r['peak_above_before'] / MiB:.1f}" for r in run.results)
            shards = ", ".join(f"{r['shard_bytes'] / MiB:.1f}" for r in run.results)
            print(f"{mode:>16}: peak RSS above before, per rank (MiB): {peaks}; parameters held (MiB): {shards}")
            if mode == "zero3":
                saves = ", ".join(f"{r['save_peak_above_before'] / MiB:.1f}" for r in run.results)
                largest = run.results[0]["largest_parameter_bytes"] / MiB
                print(f"{'full save':>16}: peak above before (MiB): {saves}; largest parameter {largest:.1f}")
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
