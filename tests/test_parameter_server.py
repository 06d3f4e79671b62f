"""Parameter-server training: sync parity with one process, ssp's bound, async staleness, CLI, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ndtrain import trainer
from ndtrain.config import ParallelConfig, PSConfig, config_from_dict, load_config
from ndtrain.engine import Engine, NonFiniteError
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.ps.messages import APPLIED, PSSetup, shard_parameters, trainable_parameters
from ndtrain.ps.server import ParameterServer, async_lr_scale
from ndtrain.ps.worker import PSWorker
from ndtrain.parallel.data.param_groups import no_decay_for_vectors, parameter_groups
from ndtrain.ps.engine import PSEngine, check_ps_config
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import train_reference
from tests.helpers.runner import init_method, run_distributed
from tests.helpers.runs import corpus_file

TOL = 1e-5
STEPS, MICRO, SEQS, SEQ_LEN, CLIP, LR = 5, 2, 2, 16, 0.05, 3e-3  # LR: the default run's


def lr_lambda(k: int) -> float:
    return min(1.0, (k + 1) / 3)


def adamw(groups: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=0.1)


def micro_batches(worker: int, step: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    tokens = torch.randint(0, vocab, (MICRO, SEQS, SEQ_LEN + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def tiny():
    return build_model(config_from_dict({"model": {"preset": "tiny"}}).model, seed=0)


def reference(workers: int, norms: list[float] | None = None) -> list[torch.Tensor]:
    """One process, the whole global batch per step, AdamW, clipping and schedule as the servers
    (each step's gradient norm before clipping appended to `norms`)."""
    model = tiny()
    opt = adamw(parameter_groups(model, no_decay_for_vectors))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    steps = [[b for w in range(workers) for b in micro_batches(w, step, model.cfg.vocab_size)] for step in range(STEPS)]
    batches = [(torch.cat([b[0] for b in bs]), torch.cat([b[1] for b in bs])) for bs in steps]
    result = train_reference(model, opt, batches, clip=CLIP, scheduler=sched)
    if norms is not None:
        norms.extend(result.norms)
    return list(result.params.values())


def flat(params) -> torch.Tensor:
    """A copy of `params` end to end (a shard's layout in a message)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


class RecordingServer(ParameterServer):
    """A server that keeps its parameters x_v after every update v (v = 0: the start)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.history = [flat(self.params)]

    def _apply(self, *args):
        outcome = super()._apply(*args)
        if outcome.status == APPLIED:
            self.history.append(flat(self.params))
        return outcome


def run_ps(ctx, ps: PSConfig, steps: int = STEPS, batches=micro_batches) -> dict:
    model = tiny()
    setup = PSSetup.build(model, ctx, ps, steps)
    if setup.roles.is_server(ctx.rank):
        server = RecordingServer(model, ctx, setup, adamw, lr_lambda=lr_lambda, grad_clip=CLIP)
        report = server.serve()
        return {"role": "server", "applied": [(a.worker, a.step, a.staleness, a.lead) for a in report.applications],
                "updates": report.updates, "betas": {tuple(round(b, 9) for b in g["betas"]) for g in server.optimizer.param_groups},
                "history": server.history}
    worker = PSWorker(model, ctx, setup)
    pulled = []  # what the worker holds after each pull (one server: the whole shard, in model order)
    for step in range(steps):
        worker.train_step(batches(ctx.rank, step, model.cfg.vocab_size))
        pulled.append(flat(trainable_parameters(model)))
    return {"role": "worker", "params": [p.detach().clone() for p in model.parameters()],
            "versions": worker.report.versions, "pushes": worker.report.steps, "pulled": pulled}


def run_engine(ctx, ps: dict, skip_nonfinite: bool = False, poison: tuple[int, int] | None = None) -> dict:
    """`PSEngine.train_step` for STEPS steps; `poison=(rank, step)`: that worker's parameters are NaN
    before that step (its loss and gradient are NaN). Records every StepResult and a NonFiniteError."""
    cfg = config_from_dict({"ps": ps, "schedule": {"steps": STEPS},
                            "optim": {"grad_clip": CLIP, "skip_nonfinite": skip_nonfinite}})
    engine = PSEngine(tiny, adamw, ctx, cfg, lr_lambda=lr_lambda)
    results, error = [], None
    try:
        for step in range(STEPS):
            if poison == (ctx.rank, step):
                with torch.no_grad():
                    next(engine.model.parameters()).fill_(float("nan"))
            r = engine.train_step(micro_batches(ctx.rank, step, engine.model.cfg.vocab_size))
            results.append((r.loss, r.tokens, r.grad_norm, r.lr, r.skipped))
    except NonFiniteError as e:
        error = e.step
    return {"results": results, "error": error, "skipped": engine.skipped_steps, "server": engine.is_server,
            "updates": engine.server.report.updates if engine.server else None,
            "params": [p.detach().clone() for p in engine.model.parameters()]}


def _scenarios() -> dict:
    ctx = init(init_method=init_method())
    out = {
        "sync_s2": run_ps(ctx, PSConfig(servers=2, mode="sync")),
        "sync_s1": run_ps(ctx, PSConfig(servers=1, mode="sync")),
        "ssp": run_ps(ctx, PSConfig(servers=1, mode="ssp", staleness=1, slow_worker="2:4"), steps=8),
        "async": run_ps(ctx, PSConfig(servers=2, mode="async", slow_worker="1:6"), steps=8),
        "lockstep": run_ps(ctx, PSConfig(servers=1, mode="ssp", staleness=0), steps=4),
        "sent": ctx.comm.stats.snapshot(),
    }
    out["look_ahead"] = run_ps(ctx, PSConfig(servers=1, mode="async", slow_worker="1:3"), steps=6)
    out["engine_sync"] = run_engine(ctx, {"servers": 2, "mode": "sync"})
    out["nan_skip"] = run_engine(ctx, {"servers": 1, "mode": "sync"}, skip_nonfinite=True, poison=(1, 2))
    out["nan_stop_sync"] = run_engine(ctx, {"servers": 1, "mode": "sync"}, poison=(2, 3))
    out["nan_stop_async"] = run_engine(ctx, {"servers": 2, "mode": "async"}, poison=(1, 2))
    out["nan_stop_ssp"] = run_engine(ctx, {"servers": 1, "mode": "ssp", "staleness": 1}, poison=(0, 1))
    # worker 2 is told "stop" long after workers 0 and 1, which go on to the next run and push to the
    # server while it still receives from any rank in this one
    out["nan_stop_straggler"] = run_engine(ctx, {"servers": 1, "mode": "ssp", "staleness": 1, "slow_worker": "2:30"},
                                           poison=(0, 1))
    out["after"] = run_engine(ctx, {"servers": 1, "mode": "sync"})  # nothing left in flight by the stops
    if ctx.rank == 0:  # the single-process references of the sync scenarios
        norms: list[float] = []
        out["reference"] = {2: reference(2, norms), 3: reference(3)}
        out["reference_norms"] = norms
    return out


def packed(worker: int, step: int, vocab: int) -> list[tuple[torch.Tensor, ...]]:
    """`micro_batches` as packed documents (lengths 5 and 11, positions restarting) with masked targets:
    the second micro-batch's first row keeps one target, so the two hold 30 and 16."""
    out = []
    positions = torch.cat([torch.arange(5), torch.arange(11)]).expand(SEQS, -1)
    for i, (x, y) in enumerate(micro_batches(worker, step, vocab)):
        y = y.clone()
        y[:, 4] = -100  # the target crossing into the second document
        if i == 1:
            y[0, 1:] = -100
        out.append((x, y, positions))
    return out


def _one_worker() -> dict:
    """One worker + one server: async and ssp have no staleness at all (each push is applied on
    the parameters it was computed on), so they must be plain single-process training. With packed,
    masked micro-batches the one worker's loss is the mean over its targets: an Engine's."""
    ctx = init(init_method=init_method())
    out = {mode: run_ps(ctx, PSConfig(servers=1, mode=mode, staleness=0)) for mode in ("async", "ssp", "sync")}
    out["packed"] = run_ps(ctx, PSConfig(servers=1, mode="sync"), batches=packed)
    return out


def named(params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {str(i): p for i, p in enumerate(params)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_scenarios, 4)


@pytest.fixture(scope="module")
def one_worker(one_thread: None) -> list[dict]:
    results = run_distributed(_one_worker, 2)
    results[0]["reference"] = reference(1)
    return results


@pytest.mark.parametrize("scenario,workers", [("sync_s2", 2), ("sync_s1", 3)])
def test_sync_equals_single_process(results: list[dict], scenario: str, workers: int) -> None:
    expected = results[0]["reference"][workers]
    initial = list(tiny().parameters())
    for rank in range(workers):
        r = results[rank][scenario]
        assert r["role"] == "worker" and r["pushes"] == STEPS
        for got, want, start in zip(r["params"], expected, initial):
            assert rel_err(got, want) <= TOL
            assert rel_err(start.detach(), want) > 1e-3  # the parameters moved: the check can fail
        assert r["versions"] == list(range(1, STEPS + 1))
    servers = [results[rank][scenario] for rank in range(workers, 4)]
    for s in servers:
        assert s["role"] == "server" and s["updates"] == STEPS
        assert sorted(s["applied"]) == [(w, c, 0, 0) for w in range(workers) for c in range(STEPS)]  # sync: staleness 0


def test_engine_step_reports_what_the_servers_did(results: list[dict]) -> None:
    """PSEngine.train_step (2 workers + 2 servers, sync): the parameters of one process, and each
    StepResult carries the norm the servers computed (= clip_grad_norm_'s), their lr, W× the tokens."""
    expected, norms = results[0]["reference"][2], results[0]["reference_norms"]
    for rank in (0, 1):
        r = results[rank]["engine_sync"]
        assert not r["server"] and r["error"] is None and r["skipped"] == 0
        assert_params_close(named(r["params"]), named(expected), TOL)
        assert [t for _, t, *_ in r["results"]] == [2 * MICRO * SEQS * SEQ_LEN] * STEPS
        for step, (loss, _, grad_norm, lr, skipped) in enumerate(r["results"]):
            assert math.isfinite(loss) and not skipped
            assert abs(grad_norm - norms[step]) <= 1e-5 * norms[step]
            assert lr == pytest.approx(LR * lr_lambda(step), rel=1e-6)
    for rank in (2, 3):
        assert results[rank]["engine_sync"]["server"] and results[rank]["engine_sync"]["updates"] == STEPS


def test_nonfinite_push_is_skipped_with_skip_nonfinite(results: list[dict]) -> None:
    """Worker 1's step 3 is NaN (3 workers + 1 server, sync): no update that step, every rank counts
    one skip, and the poisoned worker gets the servers' parameters back."""
    for rank in range(3):
        r = results[rank]["nan_skip"]
        assert r["error"] is None and r["skipped"] == 1
        assert [skipped for *_, skipped in r["results"]] == [False, False, True, False, False]
        assert math.isnan(r["results"][2][2])
        assert_params_close(named(r["params"]), named(results[0]["nan_skip"]["params"]), 0.0)
    assert results[3]["nan_skip"]["updates"] == STEPS - 1 and results[3]["nan_skip"]["skipped"] == 1


@pytest.mark.parametrize("scenario,step", [("nan_stop_sync", 4), ("nan_stop_async", None), ("nan_stop_ssp", None),
                                           ("nan_stop_straggler", None)])
def test_nonfinite_push_stops_every_rank(results: list[dict], scenario: str, step: int | None) -> None:
    """Without skip_nonfinite every rank raises NonFiniteError (none waits for the others): sync at
    the poisoned step with nothing updated; async/ssp on each worker's next exchange. The run after
    the stops ends bitwise where the same run ended before them: no message of a stopped run reached it."""
    errors = [results[rank][scenario]["error"] for rank in range(4)]
    assert all(e is not None for e in errors), errors
    if step is not None:
        assert errors == [step] * 4
        assert results[3][scenario]["updates"] == step - 1
    for rank in range(3):
        after = results[rank]["after"]
        assert after["error"] is None and len(after["results"]) == STEPS
        assert_params_close(named(after["params"]), named(results[rank]["sync_s1"]["params"]), 0.0)


@pytest.mark.parametrize("mode", ["async", "ssp", "sync"])
def test_one_worker_equals_single_process(one_worker: list[dict], mode: str) -> None:
    worker, server = one_worker[0][mode], one_worker[1][mode]
    for got, want in zip(worker["params"], one_worker[0]["reference"]):
        assert rel_err(got, want) <= TOL
    assert worker["versions"] == list(range(1, STEPS + 1))
    assert server["applied"] == [(0, c, 0, 0) for c in range(STEPS)]


def test_one_worker_on_packed_masked_batches_equals_the_engine(one_worker: list[dict]) -> None:
    """The worker weights its micro-batches by their targets and hands the model their positions."""
    engine = Engine(tiny, adamw, init(), ParallelConfig(), grad_clip=CLIP,
                    scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
    for step in range(STEPS):
        engine.train_step(packed(0, step, engine.model.cfg.vocab_size))
    for got, want in zip(one_worker[0]["packed"]["params"], engine.model.parameters()):
        assert rel_err(got, want.detach()) <= TOL


def test_ssp_never_exceeds_its_bound(results: list[dict]) -> None:
    server = results[3]["ssp"]
    assert server["role"] == "server" and server["updates"] == 3 * 8
    leads = [lead for *_, lead in server["applied"]]
    assert len(leads) == 24 and min(leads) >= 0
    assert max(leads) <= 1  # the bound is on clocks: at most 1 step ahead of the slowest worker
    assert max(s for _, _, s, _ in server["applied"]) >= 1
    # Each worker's steps arrive in order, every one of them exactly once.
    for w in range(3):
        assert [c for u, c, *_ in server["applied"] if u == w] == list(range(8))


def test_staleness_counts_the_updates_between_pull_and_apply(results: list[dict]) -> None:
    """ssp(0) with 3 workers: everyone pulls the same version after each round, so within a round
    the gradients applied 1st, 2nd, 3rd are 0, 1 and 2 updates stale (clock lead 0)."""
    applied = results[3]["lockstep"]["applied"]
    assert len(applied) == 12
    for c in range(4):
        assert [(step, s, lead) for _, step, s, lead in applied[3 * c : 3 * c + 3]] == [(c, 0, 0), (c, 1, 0), (c, 2, 0)]


def test_async_applies_every_push_as_it_arrives(results: list[dict]) -> None:
    for rank in (2, 3):
        server = results[rank]["async"]
        assert server["updates"] == 16  # one update per push, not per round
        for w in range(2):
            assert [c for u, c, *_ in server["applied"] if u == w] == list(range(8))
        assert min(s for _, _, s, _ in server["applied"]) >= 0
    # The slow worker (1) computes while the fast one (0) pushes several times: its gradients are
    # stale by those updates, and worker 0 runs ahead of worker 1's clock.
    applied = results[2]["async"]["applied"]
    assert max(s for w, _, s, _ in applied if w == 1) >= 2
    assert max(lead for w, _, _, lead in applied if w == 0) >= 1
    assert results[0]["async"]["pushes"] == 8 and results[1]["async"]["pushes"] == 8


def test_async_rule_by_hand(results: list[dict], one_worker: list[dict]) -> None:
    """lr/(W(1+τ)): 2 workers one update late get lr/4; Adam's betas are the optimizer's in every mode."""
    assert async_lr_scale(2, 1) == 0.25 and async_lr_scale(2, 0) == 0.5 and async_lr_scale(1, 0) == 1.0
    assert async_lr_scale(4, 3) == 1 / 16
    for betas in (results[2]["async"]["betas"], results[3]["ssp"]["betas"], results[3]["sync_s1"]["betas"],
                  one_worker[1]["async"]["betas"]):
        assert betas == {(0.9, 0.999)}  # AdamW's defaults


def test_async_answers_look_ahead_by_the_workers_staleness(results: list[dict]) -> None:
    """Mid-run a worker receives x_v + τ·(x_v − x_(v−1)): v the version the server answered at, τ the
    staleness of the gradient it had just applied from that worker; its last answer is x itself."""
    server = results[3]["look_ahead"]
    history, applied = server["history"], server["applied"]
    assert len(history) == server["updates"] + 1 == 19  # 3 workers × 6 pushes
    assert {tau for *_, tau, _ in applied} >= {0, 1, 2}  # the straggler's gradients wait for the others'
    for w in range(3):
        worker = results[w]["look_ahead"]
        for step, (version, received) in enumerate(zip(worker["versions"], worker["pulled"])):
            if step == 5:
                assert torch.equal(received, history[-1])  # the final parameters themselves
                continue
            tau = next(t for u, c, t, _ in applied if (u, c) == (w, step))
            x, update = history[version], history[version] - history[version - 1]
            assert torch.allclose(received, x + tau * update, rtol=0, atol=1e-6), (w, step, tau)


def test_push_pull_bytes(results: list[dict]) -> None:
    """Worker: one push per server per step = its shard + a 4-byte header; exact byte counts."""
    sent = results[0]["sent"]["send/world"]
    psi = sum(p.numel() for p in tiny().parameters())
    pushes = {"sync_s2": (STEPS, 2), "sync_s1": (STEPS, 1), "ssp": (8, 1), "async": (8, 2), "lockstep": (4, 1)}
    assert sent["calls"] == sum(steps * servers for steps, servers in pushes.values())
    assert sent["wire_bytes"] == sum(steps * (4 * psi + 4 * servers) for steps, servers in pushes.values())


def test_one_training_loop() -> None:
    """The Trainer's loop drives the parameter server (run/engine_kinds.py): no second loop is left."""
    package = Path(trainer.__file__).parent
    assert not (package / "ps_trainer.py").exists()
    sources = package.rglob("*.py")
    assert [p.name for p in sources if "ps_trainer" in p.read_text() or "PSTrainer" in p.read_text()] == []


def test_shard_parameters_balances_bytes() -> None:
    assert shard_parameters([10, 40, 30, 20], 2) == [[0, 1], [2, 3]]  # 40→0, 30→1, 20→1, 10→0: 50/50
    assert shard_parameters([5, 5, 5], 3) == [[0], [1], [2]]
    with pytest.raises(UserError, match="ps.servers=4 exceeds"):
        shard_parameters([1, 2, 3], 4)


@pytest.mark.parametrize("bad", ["2", "a:2", "1:0.5", "-1:2", "1:x", "1:2:3"])
def test_bad_slow_worker_is_a_user_error(bad: str) -> None:
    with pytest.raises(UserError, match="ps.slow_worker"):
        load_config(None, {"ps.servers": 1, "ps.slow_worker": bad})


def test_world_checks() -> None:
    cfg = load_config(None, {"ps.servers": 3})
    with pytest.raises(UserError, match="ps.servers=3 leaves no worker among 3 processes"):
        check_ps_config(cfg, 3)
    cfg = load_config(None, {"ps.servers": 1, "ps.slow_worker": "2:2"})
    with pytest.raises(UserError, match="rank 2 is not a worker"):
        check_ps_config(cfg, 3)
    assert check_ps_config(load_config(None, {"ps.servers": 1, "ps.slow_worker": "1:2"}), 3) == 2
    with pytest.raises(UserError, match="ps.staleness must be >= 0"):
        load_config(None, {"ps.servers": 1, "ps.staleness": -1})
    with pytest.raises(UserError, match="checkpoint.save_every does not combine"):
        check_ps_config(load_config(None, {"ps.servers": 1, "checkpoint.save_every": 2}), 3)
    with pytest.raises(UserError, match="parallel.tp/pp/cp does not combine with parameter-server training"):
        check_ps_config(load_config(None, {"ps.servers": 1, "parallel.tp": 2}), 3)
    with pytest.raises(UserError, match="parallel.precision=bf16 does not combine with parameter-server training"):
        check_ps_config(load_config(None, {"ps.servers": 1, "parallel.precision": "bf16"}), 3)


def ndtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ndtrain", *args], capture_output=True, text=True, timeout=240)


def test_cli_async_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = ndtrain(
        "train", "--ps.servers", "1", "--ps.mode", "async", "--nproc", "3", "--model", "tiny", "--steps", "4",
        "--data", corpus_file(tmp_path), "--out", str(out), "--set", "schedule.global_batch=8",
        "--set", "schedule.micro_batch=2", "--set", "log.progress=false", "--set", "data.eval_samples=8",
        "--set", "log.log_every=1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 worker(s) (ranks 0..1) + 1 server(s) on 3 cpu process(es)" in proc.stdout
    assert "pushes/s per worker" in proc.stdout and "staleness histogram" in proc.stdout
    assert "ndtrain: summary (parameter server)" in proc.stdout and "skipped steps" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    ps = summary["ps"]
    assert ps["mode"] == "async" and ps["workers"] == 2 and ps["updates_applied"] == 8
    assert len(ps["pushes_per_s"]) == 2 and all(p > 0 for p in ps["pushes_per_s"])
    assert sum(ps["staleness_histogram"].values()) == 8
    assert summary["tokens"] == 4 * 8 * 32 and summary["val_loss"] < 6.0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and "val_loss" in records[-1]
    assert 0 <= records[-1]["val_accuracy"] <= 1 and summary["val_ppl"] > 1  # the workers' tallies, summed
    # The Trainer's step record (as every other run's), plus worker 0's pushes/s and pulled version.
    for r in records:
        assert set(r) >= {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "comm_bytes_per_step",
                          "peak_memory_bytes", "skipped", "loss_scale", "pushes_per_s", "version"}
        assert r["grad_norm"] > 0 and r["lr"] > 0 and r["skipped"] is False and r["tokens_per_s"] > 0
    assert set(summary) >= {"model_state_bytes_rank0", "peak_memory_bytes_max_rank", "skipped_steps", "restarts"}
    assert summary["skipped_steps"] == 0 and summary["model_state_bytes_rank0"]["optimizer"] == 0  # workers keep none
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["rank_0.log", "rank_1.log", "rank_2.log"]
    assert not (out / "checkpoints").exists()  # parameter-server runs write none
    assert (out / "loss.png").exists()


def test_cli_servers_fill_the_world_one_line() -> None:
    proc = ndtrain("train", "--ps.servers", "2", "--nproc", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ndtrain: error: ps.servers=2 leaves no worker among 2 processes: use ps.servers < 2 or more processes (--nproc)"
    ]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_async_converges_like_sync_on_the_default_model(tmp_path: Path) -> None:
    """The default run (small model, 200 steps × 32 sequences) as 2 workers + 1 server: after the same
    samples, async's validation loss is within 10% of sync's (and both learn: far below ln 256)."""
    val = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        proc = subprocess.run(
            [sys.executable, "-m", "ndtrain", "train", "--nproc", "3", "--ps.servers", "1", "--ps.mode", mode,
             "--out", str(out), "--set", "log.progress=false"],
            capture_output=True, text=True, timeout=1800,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["tokens"] == 200 * 32 * 128
        val[mode] = summary["val_loss"]
    assert val["sync"] < 3.0
    assert val["async"] <= 1.10 * val["sync"], val
