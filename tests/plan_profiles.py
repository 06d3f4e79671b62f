"""Synthetic CPU profiles (the JSON `ndtrain plan --calibrate` writes) for the planner's tests."""

from __future__ import annotations

from typing import Any

from ndtrain.plan.cpu_profile import VERSION, model_key, shard_key
from ndtrain.plan.arch import ModelSpec

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def fit(latency_us: float, bandwidth_gbs: float) -> dict[str, float]:
    return {"latency_us": latency_us, "bandwidth_gbs": bandwidth_gbs}


def cpu_profile(cores: int = 2, pieces: dict[ModelSpec, dict[str, dict[str, float]]] | None = None,
                sharing: float = 1.0) -> dict[str, Any]:
    """A current-version profile: 100/60 GFLOP/s at 1/2 processes; per op a distinct α–β per (P, n) so a
    test can tell which fit was used: α = 100·P + 10·n + op index µs, B = 1/(P·n·(op index + 1)) GB/s;
    a compute chunk of 4 ms at P = 2 and 8·`sharing` ms at P = 4.
    `pieces`: model -> {threads: {shard key or "adamw": times}}."""
    collectives: dict[str, Any] = {
        str(p): {op: {str(n): fit(100 * p + 10 * n + i, 1 / (p * n * (i + 1)))
                      for n in (2, 4) if n <= p and (op != "send_recv" or n == 2)}
                 for i, op in enumerate(OPS)}
        for p in (2, 4)
    }
    collectives["2"]["chunk_ms"], collectives["4"]["chunk_ms"] = 4.0, 8.0 * sharing
    return {
        "kind": "ndtrain-cpu-profile", "version": VERSION, "cores": cores,
        "matmul_gflops": {"fp32": {"1": 100.0, "2": 60.0}, "bf16": {"1": 2.0}},
        "memory_gbs": {"1": 20.0, "2": 12.0}, "memory_total_gib": 16.0, "process_baseline_mib": {"ndtrain": 300.0, "hf": 450.0},
        "collectives": collectives,
        "models": {model_key(m): by_threads for m, by_threads in (pieces or {}).items()},
    }


def pieces(layer_f: float, layer_b: float, head_f: float, head_b: float, split_overhead: float = 0.0) -> dict[str, float]:
    """A block's times; its split backward is half input pass, half weight passes, each
    `split_overhead` longer than half the backward."""
    half = layer_b / 2 * (1 + split_overhead)
    return {"layer_f": layer_f, "layer_b": layer_b, "head_f": head_f, "head_b": head_b, "layer_i": half, "layer_w": half}


def bench_pieces(tps: tuple[int, ...] = (1, 2), split_overhead: float = 0.0) -> dict[str, dict[str, Any]]:
    """Round numbers for the bench model at 1 thread: a block 40+80 ms at tp1 mbs1, half per tp2 plus 10%,
    the ends 5+10 ms; AdamW 10 ns per element; zb's input and weight passes each half the backward
    × (1 + `split_overhead`)."""
    table: dict[str, Any] = {"adamw": {"s_per_param": 1e-8}}
    for tp in tps:
        scale = 1.0 if tp == 1 else 1.1 / tp
        table[shard_key(tp, 1)] = pieces(0.040 * scale, 0.080 * scale, 0.005, 0.010, split_overhead)
    return {"1": table}
