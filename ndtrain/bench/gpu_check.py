"""`make gpu-check`: what one CUDA GPU proves and measures, in one command, in one table.

Steps (each with its own time budget; the whole fits in 8 minutes on an H100):
1. imports: torch (the installed one: nothing is downloaded), and whether transformers/safetensors
   are there (tests needing them skip, naming the reason).
2. tests: `pytest -m cuda tests/test_cuda.py` (budget 240 s): passed / failed / skipped.
3. step: the `bench-100m` preset in bf16, one GPU, micro-batch `batch` × the preset's sequence:
   ndtrain's `Engine.train_step` (bf16 compute, fp32 masters, AdamW) against a plain PyTorch loop
   on the same model (fp32 weights under `torch.autocast(bf16)`, fused AdamW), alternating
   repeats of `steps` timed steps each (budget 150 s): median step time of each, ratio ours/plain,
   tokens/s, MFU = (6·N + 12·L·d·T)·tokens/s over the GPU's bf16 peak (plan/hardware.py, by the
   device's name), peak memory (`torch.cuda.max_memory_allocated`) against plan/memory.py's
   prediction for the layout; the device's kernel time per step of each (torch.profiler, 3 steps),
   the step's busiest kernels written to `profile.txt` beside the table.
4. attention at sequence 8192 (budget 60 s): ring attention on one device (fused kernel, and
   tiles) against `scaled_dot_product_attention`, forward + backward, median time each.

Without a GPU it prints one line and exits 0. `--cpu` runs the same logic on the CPU with the tiny
preset and short sequences (a dry run of everything up to CUDA's own calls), writing its table too.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

DEFAULT_OUT = Path("gpu-check/results.md")
TESTS_BUDGET_S = 240.0
STEP_BUDGET_S = 150.0
ATTENTION_BUDGET_S = 60.0


@dataclass
class Settings:
    """What the check runs: the GPU run's sizes, or the CPU dry run's."""

    device: str
    preset: str
    batch: int
    steps: int
    repeats: int
    attention_seq: int
    run_tests: bool


GPU = Settings("cuda", "bench-100m", 16, 10, 3, 8192, True)
CPU_DRY_RUN = Settings("cpu", "tiny", 4, 3, 2, 512, False)


@dataclass
class Table:
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, step: str, figure: str, value: str) -> None:
        self.rows.append((step, figure, value))
        print(f"gpu-check: {step}: {figure} = {value}", flush=True)

    def markdown(self, header: str) -> str:
        lines = [header, "", "| step | figure | value |", "|---|---|---|"]
        return "\n".join(lines + [f"| {a} | {b} | {c} |" for a, b, c in self.rows]) + "\n"


def sync(device: str) -> None:
    """Wait for the device: timing boundaries only (never inside a step)."""
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, count: int, deadline: float) -> list[float]:
    """Seconds of each of up to `count` calls of `fn`, stopping early past `deadline` (monotonic)."""
    times = []
    for _ in range(count):
        if times and time.monotonic() > deadline:
            break
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def check_imports(table: Table) -> None:
    table.add("imports", "torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    for name in ("transformers", "safetensors", "pytest"):
        table.add("imports", name, "present" if importlib.util.find_spec(name) else "missing (its tests skip)")


def run_tests(table: Table, log: Path) -> None:
    """The cuda tests; their whole output goes to `log`, the failures' one-line reasons to the screen."""
    if importlib.util.find_spec("pytest") is None:
        table.add("tests", "cuda tests", "not run: pytest is missing")
        return
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-m", "cuda", "tests/test_cuda.py", "-p", "no:cacheprovider"]
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TESTS_BUDGET_S)
        log.write_text(done.stdout + done.stderr)
        lines = done.stdout.strip().splitlines() or ["no output"]
        summary = lines[-1]
        if done.returncode:
            print(*[line for line in lines if line.startswith(("FAILED", "ERROR"))], sep="\n", flush=True)
            print(f"gpu-check: the tests' whole output is in {log}", flush=True)
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        log.write_text(out.decode(errors="replace") if isinstance(out, bytes) else out)
        summary = f"stopped at its budget of {TESTS_BUDGET_S:.0f} s"
    table.add("tests", "pytest -m cuda", summary)


def peak_flops(device: str) -> tuple[str, float] | None:
    """The planner's GPU and its bf16 peak for this device's name (None: not one it knows)."""
    if device != "cuda":
        return None
    from ndtrain.plan.hardware import GPUS, gpu_for_device

    key = gpu_for_device(torch.cuda.get_device_name())
    return None if key is None else (key, GPUS[key].peak_flops)


def predicted_bytes(preset: str, batch: int, hardware: str) -> float:
    """plan/memory.py's prediction for one GPU, zero 0, micro-batch `batch`, bf16 mixed precision."""
    from ndtrain.config.presets import MODEL_PRESETS
    from ndtrain.plan.arch import ModelSpec
    from ndtrain.plan.hardware import Cluster, gpu
    from ndtrain.plan.layout import Layout
    from ndtrain.plan.memory import memory

    p = MODEL_PRESETS[preset]
    spec = ModelSpec(preset, "llama", p["n_layers"], p["dim"], p["n_heads"], p["n_kv_heads"], p["ffn_dim"], 256, p["seq_len"])
    layout = Layout(tp=1, pp=1, dp=1, cp=1, zero=0, mbs=batch, vpp=1, recompute="none", sp=False, schedule="none")
    return memory(spec, layout, Cluster(gpu(hardware), 1, 1), micro_batches=1).total


def kernel_time(steps: dict[str, Callable[[], None]], device: str, count: int, log: Path) -> dict[str, float]:
    """Seconds per step the device spends in its own kernels (torch.profiler over `count` steps of each):
    against the step's wall time, how far the step is from being bound by the host. Each step's
    busiest kernels go to `log`. On the CPU (dry run) the profile has no device time: 0."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    per_step: dict[str, float] = {}
    reports = []
    for name, fn in steps.items():
        with profile(activities=activities) as prof:
            for _ in range(count):
                fn()
            sync(device)
        averages = prof.key_averages()
        per_step[name] = sum(getattr(e, "self_device_time_total", 0) for e in averages) / 1e6 / count
        order = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        reports.append(f"## {name}: {count} steps, device kernels {per_step[name] * 1e3:.2f} ms per step\n"
                       + averages.table(sort_by=order, row_limit=25))
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("\n\n".join(reports))
    return per_step


def bench_step(table: Table, s: Settings, profile_log: Path) -> None:
    """ndtrain's engine step against a plain PyTorch loop on the same bf16 model; where the time goes
    (`kernel_time`) into `profile_log`."""
    from ndtrain.config import ParallelConfig, config_from_dict
    from ndtrain.dist import mesh
    from ndtrain.engine import Engine
    from ndtrain.models.llama import build_model

    model_cfg = config_from_dict({"model": {"preset": s.preset}}).model
    seq = model_cfg.seq_len
    tokens = torch.randint(0, 256, (s.batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].to(s.device), tokens[:, 1:].to(s.device)

    def adamw(groups: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=1e-4)

    parallel = ParallelConfig(device=s.device, precision="bf16")
    engine = Engine(lambda: build_model(model_cfg, seed=0), adamw, mesh.init(parallel), parallel)
    plain = build_model(model_cfg, seed=0, device=s.device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=s.device == "cuda")

    def plain_step() -> None:
        plain_opt.zero_grad(set_to_none=True)
        with torch.autocast(s.device, dtype=torch.bfloat16):
            loss = plain(x, y)
        loss.backward()
        plain_opt.step()

    def ours_step() -> None:
        engine.train_step([(x, y)])

    deadline = time.monotonic() + STEP_BUDGET_S
    timed(ours_step, s.device, 2, deadline)  # warm-up: allocator, kernels' autotuning
    timed(plain_step, s.device, 2, deadline)
    ours: list[float] = []
    ref: list[float] = []
    for _ in range(s.repeats):  # alternate, so drift hits both alike
        ours.append(statistics.median(timed(ours_step, s.device, s.steps, deadline)))
        ref.append(statistics.median(timed(plain_step, s.device, s.steps, deadline)))
    ours_s, ref_s = statistics.median(ours), statistics.median(ref)
    n = engine.parameter_count
    step = f"step {s.preset} bf16 b{s.batch}×{seq}"
    table.add(step, "parameters", f"{n:,}")
    table.add(step, "ours / plain step", f"{ours_s * 1e3:.2f} ms / {ref_s * 1e3:.2f} ms = {ours_s / ref_s:.3f}")
    tokens_per_s = s.batch * seq / ours_s
    table.add(step, "tokens/s (ours)", f"{tokens_per_s:,.0f}")
    peak = peak_flops(s.device)
    flops_per_token = 6 * n + 12 * model_cfg.n_layers * model_cfg.dim * seq
    table.add(step, "MFU (ours)", "n/a (no known GPU peak)" if peak is None else
              f"{flops_per_token * tokens_per_s / peak[1]:.1%} of {peak[0]}'s {peak[1] / 1e12:.0f} TFLOP/s")
    busy = kernel_time({"ours": ours_step, "plain": plain_step}, s.device, 3, profile_log)
    table.add(step, "device kernels per step (ours / plain)", f"n/a on the CPU (profile: {profile_log})"
              if s.device != "cuda" else
              f"{busy['ours'] * 1e3:.2f} ms / {busy['plain'] * 1e3:.2f} ms (the rest of the step: host; {profile_log})")
    if s.device == "cuda":
        del plain, plain_opt
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        timed(ours_step, s.device, 2, float("inf"))
        measured = torch.cuda.max_memory_allocated()
        predicted = "n/a" if peak is None else f"{predicted_bytes(s.preset, s.batch, peak[0]) / 2**30:.2f} GiB"
        table.add(step, "peak memory (ours) / planner", f"{measured / 2**30:.2f} GiB / {predicted}")


def bench_attention(table: Table, s: Settings) -> None:
    """Ring attention on one device (one causal block) against SDPA, forward + backward, bf16."""
    from ndtrain.dist.comm import Group
    from ndtrain.parallel.model.context import Ring, ring_attention

    heads, kv_heads, head_dim = 12, 4, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, s.attention_seq, head_dim, generator=gen).to(s.device, torch.bfloat16).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(1, heads, s.attention_seq, head_dim, generator=gen).to(s.device, torch.bfloat16)
    one = Group("cp", (0,), 0)

    def sdpa() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), dout)

    def ring(kernel: str) -> Callable[[], None]:
        def run() -> None:
            out = ring_attention(q, k, v, Ring(None, one, kernel=kernel))  # type: ignore[arg-type]
            torch.autograd.grad(out, (q, k, v), dout)
        return run

    deadline = time.monotonic() + ATTENTION_BUDGET_S
    where = f"attention seq {s.attention_seq} bf16"
    base = statistics.median(timed(sdpa, s.device, 5, deadline))
    table.add(where, "SDPA fwd+bwd", f"{base * 1e3:.2f} ms")
    for kernel in ("fused", "tiles"):
        try:
            took = statistics.median(timed(ring(kernel), s.device, 5, deadline))
            table.add(where, f"ring ({kernel}) fwd+bwd / SDPA", f"{took * 1e3:.2f} ms = {took / base:.2f}×")
        except RuntimeError as e:  # a kernel the installed torch refuses: the table says so
            table.add(where, f"ring ({kernel})", f"failed: {str(e).splitlines()[0][:120]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ndtrain.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU with the tiny preset (no CUDA calls)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where the table goes (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible (torch.cuda.is_available() is False): nothing to check here")
        return 0
    s = CPU_DRY_RUN if args.cpu else GPU
    started = time.monotonic()
    table = Table()
    check_imports(table)
    if s.run_tests:
        run_tests(table, args.out.with_name("pytest.log"))
    benches: dict[str, Callable[[], None]] = {
        "bench_step": lambda: bench_step(table, s, args.out.with_name("profile.txt")),
        "bench_attention": lambda: bench_attention(table, s),
    }
    for name, bench in benches.items():
        try:
            bench()
        except Exception as e:  # one failing bench leaves the others' figures
            table.add(name, "error", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    device = torch.cuda.get_device_name() if s.device == "cuda" else "CPU (dry run: no GPU figure)"
    header = (f"# gpu-check on {device}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"{time.strftime('%Y-%m-%d')}, {time.monotonic() - started:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table.markdown(header))
    print(table.markdown(header))
    print(f"gpu-check: table written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
