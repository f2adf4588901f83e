"""Ratios, targets and the markdown/summary text of the decode benchmark's results.

results.update(analyse(results))     # adds "ratios" and "targets"
Path("BENCHMARKS.md").write_text(markdown(results))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FULL = "cg/FULL/inductor"
PIECEWISE = "cg/PIECEWISE/inductor"
FULL_AND_PIECEWISE = "cg/FULL_AND_PIECEWISE/inductor"
CAPTURE_LIMIT_S = 15.0
SKIP_GUARDS = "/skip-module-guards"
HINT = "/hint"  # the batch marked with hint= the largest capture size
# Both paths explicitly, with the hint (the default takes the partition where available)
F_AND_P_PARTITION = "cg/FULL_AND_PIECEWISE/partition"
F_AND_P_FX = "cg/FULL_AND_PIECEWISE/fx-split"
PIECEWISE_PARTITION = "cg/PIECEWISE/partition"
PIECEWISE_FX = "cg/PIECEWISE/fx-split"
PAIRS = [  # (name, peer, base): the per-workload ratios the analysis reads
    ("FULL / hand_full_graph", FULL, "hand_full_graph"),
    ("FULL / reduce_overhead", FULL, "reduce_overhead"),
    ("FULL_AND_PIECEWISE / FULL", FULL_AND_PIECEWISE, FULL),
    ("FULL_AND_PIECEWISE / PIECEWISE", FULL_AND_PIECEWISE, PIECEWISE),
    ("PIECEWISE / hand_piecewise", PIECEWISE, "hand_piecewise"),
    ("PIECEWISE / FULL", PIECEWISE, FULL),
    ("PIECEWISE / compile_default", PIECEWISE, "compile_default"),
    ("PIECEWISE, module guards skipped / PIECEWISE", PIECEWISE + SKIP_GUARDS, PIECEWISE),
    (
        "PIECEWISE, module guards skipped / hand_piecewise",
        PIECEWISE + SKIP_GUARDS,
        "hand_piecewise",
    ),
    ("FULL, module guards skipped / hand_full_graph", FULL + SKIP_GUARDS, "hand_full_graph"),
    ("FULL, batch hint / hand_full_graph", FULL + HINT, "hand_full_graph"),
    ("FULL, batch hint / reduce_overhead", FULL + HINT, "reduce_overhead"),
    ("PIECEWISE, batch hint / hand_piecewise", PIECEWISE + HINT, "hand_piecewise"),
    ("FULL_AND_PIECEWISE, batch hint / FULL, batch hint", FULL_AND_PIECEWISE + HINT, FULL + HINT),
    ("FULL_AND_PIECEWISE, partition / FULL, batch hint", F_AND_P_PARTITION, FULL + HINT),
    ("FULL_AND_PIECEWISE, FX split / FULL, batch hint", F_AND_P_FX, FULL + HINT),
    ("PIECEWISE, partition / PIECEWISE, FX split", PIECEWISE_PARTITION, PIECEWISE_FX),
]


def median(results: dict[str, Any], peer: str, workload: str) -> float | None:
    cell = results["peers"].get(peer, {}).get("latency_ms", {}).get(workload, {})
    return cell.get("median_ms")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios_to(results: dict[str, Any], base: str) -> dict[str, dict[str, float | None]]:
    """Every peer's median over `base`'s median, per workload."""
    workloads = results["metadata"]["workloads"]
    return {
        peer: {w: _ratio(median(results, peer, w), median(results, base, w)) for w in workloads}
        for peer in results["peers"]
        if "latency_ms" in results["peers"][peer]
    }


def _worst(results: dict[str, Any], peer: str, base: str, workloads: list[str]) -> float | None:
    """The largest peer/base ratio over the workloads; None if any is missing."""
    values = [_ratio(median(results, peer, w), median(results, base, w)) for w in workloads]
    return None if not values or None in values else max(values)


def _target(
    name: str, measured: float | None, limit: float, at_most: bool, on_gpu: bool = True
) -> dict[str, Any]:
    if not on_gpu:
        status = "N/A"  # the targets are about CUDA graphs: off CUDA they measure nothing
    elif measured is None:
        status = "N/A"
    else:
        status = "PASS" if (measured <= limit if at_most else measured >= limit) else "MISS"
    op = "<=" if at_most else ">="
    return {"target": name, "measured": measured, "limit": f"{op} {limit:g}", "status": status}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals the modes are held to (Inductor pieces), each PASS, MISS or N/A."""
    names = results["metadata"]["workloads"]
    decode = [w for w in names if w.startswith("decode-")]
    mixed = [w for w in names if w.startswith("mixed-")]
    small = mixed[0] if mixed else "mixed-64"
    worst_ratios = [  # (name, peer, base, workloads, limit): worst peer/base <= limit
        ("FULL decode / hand_full_graph", FULL, "hand_full_graph", decode, 1.03),
        ("FULL decode / reduce_overhead", FULL, "reduce_overhead", decode, 1.0),
        ("FULL_AND_PIECEWISE decode / FULL (~)", FULL_AND_PIECEWISE, FULL, decode, 1.05),
        ("FULL_AND_PIECEWISE mixed / PIECEWISE (~)", FULL_AND_PIECEWISE, PIECEWISE, mixed, 1.05),
        ("PIECEWISE / hand_piecewise", PIECEWISE, "hand_piecewise", names, 1.05),
        ("PIECEWISE mixed / compile_default", PIECEWISE, "compile_default", mixed, 1.0),
        (
            "FULL_AND_PIECEWISE decode / FULL, batch hint",
            FULL_AND_PIECEWISE + HINT,
            FULL + HINT,
            decode,
            1.01,
        ),
        (
            "FULL_AND_PIECEWISE partition decode / FULL, batch hint",
            F_AND_P_PARTITION,
            FULL + HINT,
            decode,
            1.01,
        ),
        ("PIECEWISE partition mixed / FX split", PIECEWISE_PARTITION, PIECEWISE_FX, mixed, 1.0),
    ]
    gpu = results["metadata"]["device_type"] == "cuda"
    found = [
        _target(name, _worst(results, peer, base, w), limit, True, gpu)
        for name, peer, base, w, limit in worst_ratios
    ]
    speedup = _ratio(median(results, "compile_default", small), median(results, PIECEWISE, small))
    capture_s = results.get("cold_start_default", {}).get("capture_s")
    return [
        *found,
        _target(f"compile_default / PIECEWISE at {small} (speed-up)", speedup, 2.0, False, gpu),
        _target("cold-start capture seconds (defaults)", capture_s, CAPTURE_LIMIT_S, True, gpu),
    ]


def pair_ratios(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """PAIRS' peer/base ratio per workload (None where either is missing)."""
    workloads = results["metadata"]["workloads"]
    return {
        name: {w: _ratio(median(results, peer, w), median(results, base, w)) for w in workloads}
        for name, peer, base in PAIRS
    }


def analyse(results: dict[str, Any]) -> dict[str, Any]:
    return {
        "ratios": {
            "vs_hand_full_graph": ratios_to(results, "hand_full_graph"),
            "vs_kernel_floor": ratios_to(results, "kernel_floor"),
            "pairs": pair_ratios(results),
        },
        "targets": targets(results),
    }


def _pairs_table(results: dict[str, Any]) -> list[str]:
    workloads = results["metadata"]["workloads"]
    lines = [
        "| ratio | " + " | ".join(workloads) + " |",
        "|---|" + "---:|" * len(workloads),
    ]
    for name, row in results["ratios"]["pairs"].items():
        lines.append(f"| {name} | " + " | ".join(_num(row[w]) for w in workloads) + " |")
    return lines


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _cell(results: dict[str, Any], peer: str, workload: str) -> str:
    cell = results["peers"][peer]["latency_ms"].get(workload, {})
    if "median_ms" not in cell:
        return "error" if "error" in cell else "–"
    full = results["ratios"]["vs_hand_full_graph"][peer][workload]
    floor = results["ratios"]["vs_kernel_floor"][peer][workload]
    if full is None and floor is None:
        return f"{cell['median_ms']:.3f}"
    return f"{cell['median_ms']:.3f} ({_num(full, '.2f')}×, {_num(floor, '.2f')}×)"


def _check(peer: dict[str, Any]) -> str:
    check = peer.get("check")
    if check is None:
        return "–"
    if "rel" not in check:
        return f"FAIL ({check.get('reason', '?')})"
    return f"{'ok' if check['ok'] else 'FAIL'} {check['rel']:.3g}"


def _latency_table(results: dict[str, Any]) -> list[str]:
    workloads = results["metadata"]["workloads"]
    lines = [
        "| peer | " + " | ".join(workloads) + " | check vs eager |",
        "|---|" + "---:|" * len(workloads) + "---|",
    ]
    for name, peer in results["peers"].items():
        if "latency_ms" in peer:
            cells = [_cell(results, name, w) for w in workloads]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {_check(peer)} |")
    return lines


def _cold_row(name: str, cold: dict[str, Any]) -> str:
    sweeps = "+".join(cold.get("sweeps", []))
    cells = [
        name,
        _num(cold.get("first_call_s"), ".1f"),
        _num(cold.get("batch1_call_s"), ".1f"),
        _num(cold.get("capture_s"), ".2f"),
        f"{cold.get('capture_sizes', '–')} × {sweeps}" if sweeps else "no graphs",
        _num(cold.get("reserved_delta_mb"), ".0f"),
        _num(cold.get("free_delta_mb"), ".0f"),
    ]
    return "| " + " | ".join(cells) + " |"


def _cold_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| config | first call s | batch-1 call s | capture s | sizes × sweeps | reserved Δ MiB "
        "| free Δ MiB |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    default = results.get("cold_start_default", {})
    if "capture_s" in default:
        lines.append(_cold_row("**defaults: FULL_AND_PIECEWISE, inductor, max 512**", default))
    bulk = default.get("capture_all", {})
    if "capture_s" in bulk:
        row = {**bulk, "capture_sizes": f"{bulk['graphs']} graphs", "sweeps": ["capture_all"]}
        lines.append(_cold_row("defaults, `cgcompile.capture_all()`", row))
    for name, peer in results["peers"].items():
        if "capture_s" in peer.get("cold_start", {}):
            lines.append(_cold_row(name, peer["cold_start"]))
    return lines


def _problems(results: dict[str, Any]) -> list[str]:
    lines = []
    items = [("cold_start_default", results.get("cold_start_default", {}))]
    for name, peer in [*items, *results["peers"].items()]:
        for key in ("error", "skipped"):
            if key in peer:
                lines.append(f"- {name}: {key}: {peer[key]}")
        for workload, cell in peer.get("latency_ms", {}).items():
            if "error" in cell:
                lines.append(f"- {name} {workload}: error: {cell['error']}")
    return lines


def _target_row(t: dict[str, Any]) -> str:
    return f"| {t['target']} | {_num(t['measured'])} | {t['limit']} | {t['status']} |"


def markdown(results: dict[str, Any]) -> str:
    meta = results["metadata"]
    model = ", ".join(f"{k}={v}" for k, v in meta["model"].items())
    lines = [
        "# Decode benchmark: cgcompile CUDA-graph modes",
        "",
        f"{meta['device']}, torch {meta['torch']}, CUDA {meta['cuda']}, {meta['date']}; "
        f"total runtime {results['total_runtime_s']:.0f} s.",
        f"Model: {model}; dtype {meta['dtype']}. Timing: {meta['timing']}. Check: {meta['check']}.",
        "",
        "## Latency (ms per step; in brackets × hand_full_graph, × kernel_floor)",
        "",
        *_latency_table(results),
        "",
        "cg/MODE/COMPILER = `torch.compile(model, backend='cudagraph_modes', options=...)`; "
        "decode workloads run under `batch_hint(uniform_decode=True)`, mixed ones under False.",
        "",
        "## Cold start (first call = Dynamo + compile; batch-1 call = the same for batch 1, "
        "which gets its own graph with the default backed batch; capture = one call per "
        "capture size, or `capture_all()`)",
        "",
        *_cold_table(results),
        "",
        "## Ratios per workload (cg = Inductor pieces)",
        "",
        *_pairs_table(results),
        "",
        "## Targets (cg = Inductor pieces; ratios are the worst over the workloads named)",
        "",
        "| target | measured | limit | status |",
        "|---|---:|---|---|",
        *[_target_row(t) for t in results["targets"]],
    ]
    problems = _problems(results)
    if problems:
        lines += ["", "## Errors and skips", "", *problems]
    return "\n".join(lines) + "\n"


def summary(results: dict[str, Any], out: Path) -> str:
    tgts = results["targets"]
    counts = {s: sum(t["status"] == s for t in tgts) for s in ("PASS", "MISS", "N/A")}
    lines = [
        f"decode benchmark on {results['metadata']['device']}: "
        f"{results['total_runtime_s']:.0f} s total; results in {out}/decode-results.json, "
        f"{out}/BENCHMARKS.md",
        *[f"  {t['status']:4}  {t['target']}: {_num(t['measured'])} {t['limit']}" for t in tgts],
        "targets: " + ", ".join(f"{n} {s}" for s, n in counts.items()),
    ]
    problems = _problems(results)
    if problems:
        lines.append(f"{len(problems)} errors/skips (see BENCHMARKS.md), first: {problems[0][2:]}")
    return "\n".join(lines)
