"""The bench page of `ndtrain report bench-results/`: every `ndtrain bench` JSON result of a folder.

Per benchmark (one JSON file, `ContestResult.to_json`): each contestant's median step time, the
spread of its run medians, its ratio to the reference (PyTorch's native equivalent, or the
baseline the scenario names) and to the no-communication `limit` where the bench has one, counted
and loopback bytes per step and rank, and the peak memory of the largest rank (also less the
shared-memory pages it counts beyond its share), as a table; bar
plots of the ratios, the peaks and the loopback bytes of all benchmarks, and of each benchmark's
median step times, with the result's noise warnings. Files that are not bench results are listed,
not read (results written before the spread and limit fields render with "—" there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ndtrain.report import html as h
from ndtrain.report.plots import bars

_MIB = 2**20


def bench_files(directory: Path) -> list[tuple[Path, dict[str, Any] | str]]:
    """Every *.json of the folder, sorted by name: its bench result, or why it is not one."""
    found: list[tuple[Path, dict[str, Any] | str]] = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            found.append((path, f"not readable JSON ({e})"))
            continue
        found.append((path, data if _is_result(data) else "not an `ndtrain bench` result"))
    return found if any(isinstance(d, dict) for _, d in found) else []


def _is_result(data: Any) -> bool:
    if not isinstance(data, dict) or not isinstance(data.get("scenario"), str):
        return False
    summary = data.get("summary")
    return isinstance(summary, dict) and bool(summary) and all(
        isinstance(s, dict) and _num(s.get("median_step_s")) and _num(s.get("ratio")) for s in summary.values()
    )


def bench_page(directory: Path, files: list[tuple[Path, dict[str, Any] | str]]) -> str:
    results = [(p, d) for p, d in files if isinstance(d, dict)]
    rows, labels, ratios, peaks, loopback = [], [], [], [], []
    per_bench = []
    for path, data in results:
        reference = data.get("reference", "?")
        summary = data["summary"]
        for name, s in summary.items():
            peak = max(s.get("peak_bytes") or [0])
            over = max(s.get("peak_over_baseline_bytes") or [0])
            own = s.get("peak_own_share_bytes")  # absent in results written before it existed
            rows.append([
                path.stem, data.get("world_size", "?"), name + (" (reference)" if name == reference else ""),
                f"{s['median_step_s'] * 1e3:.2f}", _spread(s.get("spread_step_s")), f"{s['ratio']:.3f}",
                _ratio(s.get("ratio_to_limit")), _bytes(s.get("comm_bytes_per_step")),
                _bytes(s.get("loopback_bytes_per_step")), _bytes(peak), _bytes(over),
                _bytes(max(own) if own else None),
            ])
            labels.append(f"{path.stem}: {name}")
            ratios.append(s["ratio"])
            peaks.append(peak / _MIB)
            loop = s.get("loopback_bytes_per_step")
            loopback.append(loop / _MIB if _num(loop) else None)
        names = list(summary)
        plot = bars(names, {"median step (ms)": [summary[n]["median_step_s"] * 1e3 for n in names]},
                    f"{path.stem}: median step time (reference {reference})", "ms")
        facts = {**data.get("facts", {}), **{f"option {k}": v for k, v in data.get("options", {}).items()}}
        per_bench.append(h.section(
            f"{path.stem} — {data['scenario']} on {data.get('world_size', '?')} ranks",
            h.plots(h.image(f"bench-{path.stem}", plot, f"{path.stem}: median step time per contestant")),
            h.table([[k, h.fmt(k, v)] for k, v in facts.items()], ["fact", "value"]),
            *[h.note(f"warning: {w}") for w in data.get("warnings") or [] if isinstance(w, str)],
        ))
    header = ["benchmark", "ranks", "contestant", "median step (ms)", "spread of run medians (ms)", "ratio",
              "÷ limit", "counted comm/step",
              "loopback/step", "peak (largest rank)", "peak over baseline", "peak, own share of shared memory"]
    overview = [
        h.image("bench-ratio", bars(labels, {"ratio": ratios}, "Median step time ÷ the reference's", "ratio",
                                    reference_line=1.0), "ratio of each contestant's median step time to its reference"),
        h.image("bench-peak", bars(labels, {"peak": peaks}, "Peak memory of the largest rank", "MiB"),
                "peak memory per contestant (median over runs, largest rank)"),
    ]
    if any(v is not None for v in loopback):
        overview.append(h.image("bench-loopback", bars(labels, {"loopback": loopback}, "Loopback bytes per step and rank",
                                                       "MiB"), "bytes the process group sent over loopback per step"))
    sections = [
        h.section("Results", h.table(rows, header), h.note(
            "ratio = median step / the reference's median step; ÷ limit = median step / the median step of `limit` "
            "(the same step with no communication); spread = lowest–highest per-run median; "
            "bytes per rank and step; counted = through "
            "ndtrain's comm layer (none for PyTorch's own), loopback = measured on the lo interface")),
        h.section("Comparison", h.plots(*overview)),
        *per_bench,
    ]
    skipped = [f"{p.name}: {d}" for p, d in files if isinstance(d, str)]
    if skipped:
        sections.append(h.section("Other files (not read)", h.note("; ".join(skipped))))
    subtitle = f"{len(results)} benchmark result(s) from {directory.resolve()}"
    return h.page("ndtrain bench report", subtitle, sections)


def _spread(value: Any) -> str:
    ok = isinstance(value, list) and len(value) == 2 and all(_num(v) for v in value)
    return f"{value[0] * 1e3:.2f}–{value[1] * 1e3:.2f}" if ok else "—"


def _ratio(value: Any) -> str:
    return f"{value:.3f}" if _num(value) else "—"


def _bytes(value: Any) -> str:
    return h.fmt("bytes", value) if _num(value) else "—"


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
