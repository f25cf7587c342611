"""Probe: which third-party models and patterns train under ZeRO stages 1-3 the way they train under DDP.

For every fixture in ``tests/third_party_models.py`` x {ddp, zero1, zero2, zero3, zero3 built in
``configure_model``} x {"32-true", and "bf16-mixed" for the Hugging Face and TransformerEncoder fixtures}, fit
6 steps through ``lightning.pytorch.Trainer(strategy=..., accelerator="cpu", devices=2)`` on two gloo ranks
started by ``tests.harness.run_distributed`` (one harness launch per case, each with its own time limit, so a hang
or a crash is one row of the table). Lightning creates the process group itself from the harness's environment
(``init_process_group=False``, as in ``tests/test_strategy.py``); the ``zero*`` presets keep their default
``start_method="popen"``, which launches nothing when the environment says the processes already exist.

DDP is ``"ddp"``, or ``"ddp_find_unused_parameters_true"`` for fixtures where some trainable parameters get no
gradient. Columns:

* status: ``ok``, ``NaN`` (a non-finite loss), ``timeout`` (killed at the case's limit) or the error type (the
  message is listed below the table). For DDP rows, ``ref``.
* loss Δ: max over steps and ranks of |loss - loss_ddp| / |loss_ddp|.
* weight Δ: max over parameters of ||w - w_ddp|| / ||w_ddp|| (final full weights, gathered under stage 3, rank 0),
  and the parameter where it is reached.
* buffer Δ: the same over buffers (BatchNorm statistics, positional encodings), max over both ranks; ``-`` when the
  model has none.
* rank Δ: max over parameters of ||w_rank1 - w_rank0|| / ||w_rank0|| within the run: data-parallel ranks must agree.

Run: ``.venv/bin/python benchmarks/probe_third_party.py [--only NAME ...] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.harness import DistributedTestError, run_distributed  # noqa: E402
from tests.third_party_models import BUILDERS, fit_probe  # noqa: E402

STEPS = 6
WORLD_SIZE = 2
CASE_TIMEOUT_S = 120.0
COMPILE_TIMEOUT_S = 300.0  # the first inductor compile alone takes ~20-40 s per rank on 2 cores
_MARKER = "PROBE_ERROR"


def _probe_rank(builder: str, strategy: str, precision: str, build_in: str) -> dict[str, Any]:
    """One rank of one case. Any exception is re-raised with its type and message in a parseable form."""
    import lightning_zero  # noqa: F401  (registers "zero1", "zero2", "zero3")

    quiet = os.open(os.devnull, os.O_WRONLY)  # Lightning's banners and warnings; errors come back through the harness
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)

    try:
        return fit_probe(builder, strategy, precision, steps=STEPS, build_in=build_in)  # type: ignore[arg-type]
    except BaseException as error:
        # Report the first exception of the chain: one raised while handling another (e.g. in teardown after a
        # failed setup) would otherwise hide the original. The later ones are listed as "then ...".
        chain = [error]
        while chain[-1].__context__ is not None and not chain[-1].__suppress_context__ and len(chain) < 10:
            chain.append(chain[-1].__context__)
        first, *later = reversed(chain)
        described = {"type": type(first).__name__, "message": str(first), "at": _where(first)}
        described["then"] = [f"{type(e).__name__}: {str(e).splitlines()[0]} (at {_where(e)})" for e in later]
        raise RuntimeError(f"{_MARKER}{json.dumps(described)}{_MARKER}") from error


def _where(error: BaseException) -> str:
    """The innermost frame of the traceback, and the innermost one in this repository if that is another."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    ours = [f for f in frames if f.filename.startswith(str(ROOT)) and "/.venv/" not in f.filename]
    shown = [frames[-1]] + ([ours[-1]] if ours and ours[-1] is not frames[-1] else [])
    return " / ".join(
        f"{Path(f.filename).relative_to(ROOT) if f in ours else _short(f.filename)}:{f.lineno} {f.name}" for f in shown
    )


def _short(filename: str) -> str:
    return filename.split("site-packages/")[-1]


@dataclass
class Case:
    builder: str
    label: str  # the strategy column
    strategy: str
    precision: str
    build_in: str = "init"
    status: str = "?"
    message: str = ""
    seconds: float = 0.0
    runs: list[dict[str, Any]] = field(default_factory=list)  # per rank
    metrics: dict[str, Any] = field(default_factory=dict)


def _first_error(error: DistributedTestError) -> tuple[str, str]:
    """(type, message) of the rank that failed first; ranks killed after it only say so."""
    for text in error.failures.values():  # in arrival order
        found = re.search(f"{_MARKER}(.*?){_MARKER}", text, re.S)
        if found:
            described = json.loads(found.group(1))
            then = "".join(f"\n(then {t})" for t in described["then"])
            return described["type"], f"{described['message']}\n(raised at {described['at']}){then}"
    text = next(iter(error.failures.values()))
    if "did not finish within timeout" in text:
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\w+)', text)
        where = " <- ".join(f"{Path(f).name}:{line} {fn}" for f, line, fn in frames[:3])
        return "timeout", f"killed at the case's time limit; rank stack (innermost first): {where}"
    return "died", text.strip().splitlines()[0]


def run_case(case: Case) -> None:
    timeout = COMPILE_TIMEOUT_S if case.builder == "compiled_mlp" else CASE_TIMEOUT_S
    start = time.monotonic()
    try:
        case.runs = run_distributed(
            _probe_rank,
            WORLD_SIZE,
            case.builder,
            case.strategy,
            case.precision,
            case.build_in,
            timeout=timeout,
            init_process_group=False,
        )
    except DistributedTestError as error:
        kind, message = _first_error(error)
        case.status, case.message = kind, message
    else:
        bad = [(run["rank"], step) for run in case.runs for step, x in enumerate(run["losses"]) if not math.isfinite(x)]
        case.status = "ok" if not bad else "NaN"
        if bad:
            weights = case.runs[0]["weights"]
            nonfinite = [n for n, w in weights.items() if not torch.isfinite(w).all()]
            first = min(step for _, step in bad)
            case.message = (
                f"loss not finite from step {first} (0-based) on rank(s) {sorted({r for r, s in bad if s == first})}"
                f"\nfinal parameters not finite: {len(nonfinite)} of {len(weights)} ({', '.join(nonfinite[:4])}"
                f"{', ...' if len(nonfinite) > 4 else ''})"
            )
    case.seconds = time.monotonic() - start


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _max_rel(candidate: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float | None, str]:
    """The largest relative difference and its tensor (NaN wins; ``-`` when all are equal)."""
    if not reference:
        return None, "-"
    if candidate.keys() != reference.keys():
        return math.inf, "names differ"
    deltas = [(_rel(candidate[n], reference[n]), n) for n in reference]
    worst = next((d for d in deltas if math.isnan(d[0])), None) or max(deltas, key=lambda t: t[0])
    return worst if worst[0] != 0 else (0.0, "-")


def compare(case: Case, reference: Case) -> None:
    if case.status not in ("ok", "NaN"):
        return
    rank_delta, _ = _max_rel(case.runs[1]["weights"], case.runs[0]["weights"])
    case.metrics["rank"] = rank_delta
    if reference is case or reference.status not in ("ok", "NaN"):
        return
    loss_delta = 0.0
    for mine, theirs in zip(case.runs, reference.runs, strict=True):
        if len(mine["losses"]) != len(theirs["losses"]):
            loss_delta = math.inf
            break
        for x, y in zip(mine["losses"], theirs["losses"], strict=True):
            delta = abs(x - y) / max(abs(y), 1e-12)
            loss_delta = delta if math.isnan(delta) else max(loss_delta, delta)
            if math.isnan(loss_delta):
                break
    case.metrics["loss"] = loss_delta
    case.metrics["weight"], case.metrics["worst"] = _max_rel(case.runs[0]["weights"], reference.runs[0]["weights"])
    pairs = zip(case.runs, reference.runs, strict=True)
    buffers = [_max_rel(mine["buffers"], theirs["buffers"])[0] for mine, theirs in pairs]
    case.metrics["buffer"] = None if buffers[0] is None else max(buffers, key=lambda d: (math.isnan(d), d))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return "inf" if math.isinf(value) else f"{value:.1e}"
    return str(value)


def table(cases: list[Case]) -> str:
    header = ("model", "precision", "strategy", "status", "loss Δ", "weight Δ", "worst parameter", "buffer Δ", "rank Δ")
    rows = [header]
    for c in cases:
        status = "ref" if c.label.startswith("ddp") and c.status == "ok" else c.status
        m = c.metrics
        worst = str(m.get("worst", "-"))
        worst = worst if len(worst) <= 44 else "…" + worst[-43:]
        rows.append(
            (
                c.builder,
                c.precision,
                c.label,
                status,
                _fmt(m.get("loss")),
                _fmt(m.get("weight")),
                worst,
                _fmt(m.get("buffer")),
                _fmt(m.get("rank")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def errors(cases: list[Case]) -> str:
    lines = []
    for c in cases:
        if c.status == "ok":
            continue
        lines_ = c.message.strip().splitlines()
        at = [x for x in lines_ if x.startswith(("(raised at ", "(then "))]
        message = "\n    ".join(lines_[:2] + [x for x in at if x not in lines_[:2]])
        lines.append(f"* {c.builder} / {c.precision} / {c.label}: {c.status}: {message}")
    return "\n".join(lines) if lines else "(none)"


def plan(only: list[str] | None) -> list[list[Case]]:
    """Groups of cases; the first case of each group is its DDP reference."""
    groups = []
    for name, builder in BUILDERS.items():
        if only and name not in only:
            continue
        fixture = builder()
        ddp = "ddp_find_unused_parameters_true" if fixture.unused_parameters else "ddp"
        precisions = ["32-true", "bf16-mixed"] if fixture.mixed_precision else ["32-true"]
        for precision in precisions:
            group = [Case(name, "ddp" + ("+unused" if fixture.unused_parameters else ""), ddp, precision)]
            group += [Case(name, f"zero{s}", f"zero{s}", precision) for s in (1, 2, 3)]
            if precision == "32-true":
                group.append(Case(name, "zero3 meta", "zero3", precision, build_in="configure_model"))
            groups.append(group)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(BUILDERS), help="probe only these fixtures")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    args = parser.parse_args()

    import lightning
    import peft
    import transformers

    started = time.monotonic()
    cases: list[Case] = []
    for group in plan(args.only):
        reference = group[0]
        for case in group:
            run_case(case)
            compare(case, reference)
            cases.append(case)
            print(
                f"[{time.monotonic() - started:6.0f} s] {case.builder} {case.precision} {case.label}: {case.status}"
                f" ({case.seconds:.1f} s) {case.message.splitlines()[0] if case.message else ''}",
                file=sys.stderr,
                flush=True,
            )
    versions = (
        f"torch {torch.__version__}, lightning {lightning.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}, python {platform.python_version()}"
    )
    report = "\n".join(
        [
            f"# probe_third_party.py: {STEPS} steps, world size {WORLD_SIZE}, gloo on CPU, AdamW(lr=1e-2, wd=0.01)",
            f"# {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; {versions}",
            f"# total {time.monotonic() - started:.0f} s; "
            "'zero3 meta' builds the model in configure_model (meta device, reset_parameters() init; "
            "its weight Δ includes any difference in initialization)",
            "",
            table(cases),
            "",
            "Failures (type: first two lines of the message, from the rank that failed first; where it was raised):",
            errors(cases),
            "",
        ]
    )
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()
