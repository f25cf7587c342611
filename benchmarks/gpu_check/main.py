"""One command that learns what a GPU machine has to teach the project, within a fixed time (``scripts/gpu_check.sh``).

    bash scripts/gpu_check.sh OUT                       # on a GPU machine: <= 8 minutes on one H100
    bash scripts/gpu_check.sh --device cpu --dry OUT    # tiny sizes on the CPU (tests/test_gpu_check.py)

Sections run one after the other, most valuable first, each with its own time budget: a section's ranks are
processes of ``tests.harness.run_distributed`` (or, for the tests, a ``pytest`` process group), killed with a stack
dump when the budget runs out, so one hanging part cannot eat the rest. After every section ``OUT/summary.json``
and ``OUT/summary.md`` are rewritten: a section that fails records its error (and what it had noted so far) and the
script goes on. The status of a section is ``ok``, ``failed`` (an error, a timeout, or a check that did not hold:
``failed_checks``) or ``skipped`` with its reason. The exit code is 0 whenever the summary was written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for path in (str(ROOT), str(ROOT / "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

from gpu_check import full_save, gpt, offload_speed, sections, throughput  # noqa: E402  (after the path set-up above)
from gpu_check.common import Config, Ledger, brief  # noqa: E402

Section = Callable[[Config], dict[str, Any]]
SECTIONS: list[tuple[str, Section, float, float]] = [
    # name, function, budget in seconds on a GPU, budget in the dry mode
    ("environment", sections.environment, 15, 15),
    ("gloo_cuda_probe", sections.gloo_probe, 20, 15),
    ("gpu_tests", sections.gpu_tests, 190, 30),
    ("host_syncs", sections.host_syncs, 30, 20),
    ("gpt_stage3_vs_fsdp2", gpt.stage3_vs_fsdp2, 65, 25),
    ("full_save_nccl", full_save.full_save_nccl, 20, 15),
    ("offload_largest_model", gpt.offload_largest, 160, 25),
    ("offload_speed", offload_speed.offload_speed, 150, 25),
    ("gpt_throughput", throughput.gpt_throughput, 300, 40),  # alone: --only gpt_throughput
]
TOTAL_BUDGET = {"gpu": 480.0, "dry": 95.0}


def parse(argv: list[str]) -> tuple[Config, float, float, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for summary.json, summary.md and the logs")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dry", action="store_true", help="tiny sizes and budgets (the CPU test)")
    parser.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    parser.add_argument("--total-budget", type=float, default=None, help="seconds for everything")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every budget (a loaded machine)")
    parser.add_argument("--offload-modes", default="", help="offload_largest_model: comma-separated modes to run")
    parser.add_argument("--offload-layers", type=int, default=0, help="offload_largest_model: the depth to start at")
    parser.add_argument("--inject-failure", default="", help="tests only: this section raises at its start")
    parser.add_argument("--inject-hang", default="", help="tests only: this section's ranks hang at their start")
    ns = parser.parse_args(argv)
    names = [name for name, *_ in SECTIONS]
    only = [s for s in ns.only.split(",") if s]
    for given in [*only, *(s for s in (ns.inject_failure, ns.inject_hang) if s)]:
        if given not in names:
            parser.error(f"unknown section {given!r}; known: {names}")
    config = Config(
        out=str(ns.out.resolve()),
        device=ns.device,
        dry=ns.dry,
        inject_failure=ns.inject_failure,
        inject_hang=ns.inject_hang,
        offload_modes=tuple(m for m in ns.offload_modes.split(",") if m),
        offload_layers=ns.offload_layers,
    )
    total = ns.total_budget if ns.total_budget is not None else TOTAL_BUDGET["dry" if ns.dry else "gpu"]
    return config, total * ns.budget_scale, ns.budget_scale, only or names


def render(summary: dict[str, Any]) -> str:
    """summary.md: one line per section, then each section's result as JSON (what a reader needs, no more)."""
    lines = [
        "# GPU check",
        "",
        f"device: {summary['device']}{' (dry)' if summary['dry'] else ''}; started {summary['started']}; "
        f"{summary['elapsed_s']:.0f} s of {summary['total_budget_s']:.0f} s",
        "",
        "| section | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for name, record in summary["sections"].items():
        note = record.get("reason") or record.get("error", "").strip().splitlines()[-1:] or ""
        if isinstance(note, list):
            note = note[0] if note else ""
        checks = record.get("failed_checks")
        if checks:
            note = "; ".join(checks)
        note = str(note).replace("|", "\\|")[:300]
        lines.append(f"| {name} | {record['status']} | {record.get('seconds', 0):.1f} | {note} |")
    for name, record in summary["sections"].items():
        lines += ["", f"## {name}: {record['status']}", "", "```json", json.dumps(record, indent=1)[:20_000], "```"]
    return "\n".join(lines) + "\n"


def write(out: Path, summary: dict[str, Any]) -> None:
    for name, text in (("summary.json", json.dumps(summary, indent=1)), ("summary.md", render(summary))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)  # a reader never sees half a file, also if the script is killed meanwhile


def run_section(name: str, fn: Section, config: Config, ledger: Ledger) -> dict[str, Any]:
    start = time.monotonic()
    try:
        if config.inject_failure == name:
            raise RuntimeError(f"injected failure in section {name!r} (--inject-failure)")
        result = fn(config)
        status = result.pop("status", "ok")
        record: dict[str, Any] = {"status": status, **result}
        if record.get("failed_checks"):
            record["status"] = "failed"
    except Exception as error:
        record = {"status": "failed", "error": brief(error), "detail": f"{type(error).__name__}: {error}"[-6000:]}
        record["traceback"] = traceback.format_exc()[-3000:]
    notes = ledger.read()
    if notes and record["status"] != "ok":
        record["partial"] = notes  # what the section had found before it failed
    record["seconds"] = round(time.monotonic() - start, 1)
    return record


def main(argv: list[str]) -> int:
    config, total, scale, selected = parse(argv)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    begin = time.monotonic()
    summary: dict[str, Any] = {
        "device": config.device,
        "dry": config.dry,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "total_budget_s": total,
        "elapsed_s": 0.0,
        "config": asdict(config),
        "sections": {},
    }
    write(out, summary)
    for name, fn, gpu_budget, dry_budget in SECTIONS:
        if name not in selected:
            continue
        left = total - (time.monotonic() - begin)
        budget = min((dry_budget if config.dry else gpu_budget) * scale, left - 2)
        if config.inject_hang == name:
            budget = min(budget, 8.0)  # tests only: the hang is ended by the section's budget; keep it short
        if budget < 5:
            record: dict[str, Any] = {"status": "skipped", "reason": f"no time left ({left:.0f} s of {total:.0f} s)"}
        else:
            print(f"[gpu_check] {name}: budget {budget:.0f} s", flush=True)
            ledger = Ledger(out / f".{name}.notes.jsonl")
            record = run_section(name, fn, config.with_budget(budget, name), ledger)
            ledger.remove()
        summary["sections"][name] = record
        summary["elapsed_s"] = round(time.monotonic() - begin, 1)
        print(f"[gpu_check] {name}: {record['status']} in {record.get('seconds', 0):.1f} s", flush=True)
        write(out, summary)
    print(render(summary).split("\n## ", 1)[0], flush=True)  # the table: also in the output when no file comes back
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
