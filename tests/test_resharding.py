"""Layout-agnostic checkpoints: save under layout A after K steps, resume under layout B, train to N.

The result must equal the uninterrupted layout-A run (fp32, relative error ≤ 1e-5 per tensor,
`tests/helpers/parity.py`), for pairs that change tp, pp, cp, the ZeRO stage (3 ↔ 0/1/2) and the number
of processes (4 ranks → 1 process, in the parent); resuming under the same layout is bit-identical.
Runs are float64, as in test_engine_layouts: in fp32 the kernels' summation order alone, amplified
by AdamW on near-cancelling gradients, moves layouts apart by up to ~6e-5 in two steps (measured
here for tp2 → pp2), which would hide a misplaced slice; in float64 that noise is ~1e-13.
One spawn of 4 processes runs every 4-rank layout in turn (the groups of each are built on the one
world, as in test_engine_layouts); each A run continues past its save to N steps and is the
reference of every B resumed from it. Bad input (another model, a missing slice) ends in one line.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ndtrain.cli import commands as cli
from ndtrain.checkpoint.store import load_model_weights
from ndtrain.checkpoint.format import MODEL as MODEL_KEY, problems
from ndtrain.checkpoint.manifest import write_manifest
from ndtrain.config import ModelConfig, ParallelConfig, load_config
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.checkpoint.safe_pickle import SafeReader
from tests.helpers.parity import assert_params_close
from tests.helpers.runner import init_method, run_distributed
from tests.helpers.runs import corpus_file

K, N = 2, 4  # save after K steps, compare after N
GLOBAL_BATCH = 8
SEQ = 16
TOLERANCE = 1e-5
DTYPE = torch.float64  # see the module docstring
MODEL = ModelConfig(preset="tiny", dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=SEQ)

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp4-z0": dict(dp=4),
    "dp4-z2": dict(dp=4, zero=2),
    "dp4-z3": dict(dp=4, zero=3),
    "dp2-cp2-z0": dict(dp=2, cp=2),
    "dp2-cp2-z1": dict(dp=2, cp=2, zero=1),
    "dp2-cp2-z2": dict(dp=2, cp=2, zero=2),
    "dp2-cp2-z3": dict(dp=2, cp=2, zero=3),
    "dp2-tp2-z1": dict(dp=2, tp=2, zero=1),
    "dp2-pp2-z0": dict(dp=2, pp=2),
    "tp2-pp2-z0": dict(dp=1, tp=2, pp=2),
    "dp4-z1-bf16": dict(dp=4, zero=1, precision="bf16"),
    "dp4-z3-bf16": dict(dp=4, zero=3, precision="bf16"),
}
# (A, B): B resumes A's checkpoint of step K; "one" is the single-process run in the parent.
# FAST runs in one spawn (2 A runs, 3 B runs); SLOW, in a second spawn, completes the matrix.
FAST = [
    ("dp2-tp2-z1", "dp2-pp2-z0"),  # tp 2 → pp 2
    ("dp2-tp2-z1", "dp2-tp2-z1"),  # the same layout: bit-identical
    ("dp2-cp2-z3", "dp2-tp2-z1"),  # ZeRO-3 → ZeRO-1, cp 2 → tp 2
    ("dp2-tp2-z1", "one"),         # 4 ranks → 1 process
]
SLOW = [
    ("dp4-z0", "dp4-z3"),          # ZeRO-0 → ZeRO-3
    ("dp4-z3", "dp2-cp2-z1"),      # ZeRO-3 → ZeRO-1, cp 1 → 2
    ("dp2-cp2-z2", "dp2-tp2-z1"),  # ZeRO-2 → tp 2
    ("dp2-pp2-z0", "dp4-z3"),      # pp 2 → ZeRO-3
    ("dp4-z0", "dp2-cp2-z0"),      # cp 1 → 2
    ("dp2-tp2-z1", "tp2-pp2-z0"),  # dp2×tp2 → pp2×tp2
    ("dp2-cp2-z3", "dp4-z2"),      # ZeRO-3 → ZeRO-2, cp 2 → 1
    ("tp2-pp2-z0", "one"),         # 4 ranks → 1 process
    ("dp4-z3", "one"),
    ("dp4-z1-bf16", "dp4-z1-bf16"),  # fp32 masters are what is stored: bit-identical
    ("dp4-z1-bf16", "dp4-z3-bf16"),  # masters move between ZeroOptimizer and FSDP shards
]
SAME_LAYOUT = {(a, b) for a, b in FAST + SLOW if a == b}
BF16_TOLERANCE = 2e-2  # bf16 compute copies of equal masters, after steps under other reduction orders

State = dict[str, torch.Tensor]
pytestmark = pytest.mark.usefixtures("one_thread")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def make_engine(ctx: Any, parallel: ParallelConfig) -> Engine:
    dtype = torch.float32 if parallel.precision == "bf16" else DTYPE
    return Engine(
        lambda: build_model(MODEL, seed=0).to(dtype),
        lambda groups: torch.optim.AdamW(groups, lr=1e-3, eps=1e-6, weight_decay=0.1),
        ctx, parallel, grad_clip=0.3,
        scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    )


def train(engine: Engine, steps: range) -> None:
    dp, rank = engine.ctx.size("dp"), engine.ctx.coord("dp")
    for step in steps:
        x, y = batch(step)
        x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
        engine.train_step(list(zip(x.chunk(2), y.chunk(2))))


def resharding_worker(root: str, pairs: list[tuple[str, str]]) -> dict[str, State]:
    """Each A run: K steps, save, on to N; each B: load A's step K, train to N. Full states by run name."""
    out: dict[str, State] = {}
    for a in dict.fromkeys(a for a, _ in pairs):
        engine = make_engine(init(ParallelConfig(**LAYOUTS[a]), init_method=init_method()), ParallelConfig(**LAYOUTS[a]))
        train(engine, range(K))
        engine.save(f"{root}/{a}")
        train(engine, range(K, N))
        out[a] = engine.full_state_dict()
        for b in [b for x, b in pairs if x == a and b != "one"]:
            resumed = make_engine(init(ParallelConfig(**LAYOUTS[b]), init_method=init_method()), ParallelConfig(**LAYOUTS[b]))
            progress = resumed.load(f"{root}/{a}")
            assert progress["step"] == K and resumed.scheduler.last_epoch == K
            assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / (1 + K))
            train(resumed, range(K, N))
            out[f"{a}->{b}"] = resumed.full_state_dict()
    return out


def merged(results: list[dict[str, State]], name: str) -> State:
    """The whole model from every rank's part (pipeline stages hold disjoint parameters)."""
    state: State = {}
    for rank_result in results:
        state.update(rank_result[name])
    return state


def spawn(root: Path, pairs: list[tuple[str, str]]) -> tuple[Path, list[dict[str, State]]]:
    return root, run_distributed(resharding_worker, 4, str(root), pairs, timeout=600)


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, State]]]:
    return spawn(tmp_path_factory.mktemp("resharding"), FAST)


@pytest.fixture(scope="module")
def resharded_slow(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, State]]]:
    return spawn(tmp_path_factory.mktemp("resharding_slow"), SLOW)


@pytest.mark.parametrize(
    "a, b", [*FAST, *(pytest.param(a, b, marks=pytest.mark.slow) for a, b in SLOW)],
    ids=[f"{a}->{b}" for a, b in FAST + SLOW],
)
def test_resume_under_another_layout_continues_the_run(a: str, b: str, request: pytest.FixtureRequest) -> None:
    root, results = request.getfixturevalue("resharded" if (a, b) in FAST else "resharded_slow")
    expected = merged(results, a)
    if b == "one":
        engine = make_engine(init(ParallelConfig(dp=1)), ParallelConfig(dp=1))
        assert engine.load(root / a)["step"] == K
        train(engine, range(K, N))
        actual = engine.full_state_dict()
    else:
        actual = merged(results, f"{a}->{b}")
    tolerance = 0.0 if (a, b) in SAME_LAYOUT else BF16_TOLERANCE if "bf16" in b else TOLERANCE
    error = assert_params_close(actual, expected, tolerance, f"{a} -> {b}")
    print(f"{a} -> {b}: max relative error {error:.2e}")


def test_a_checkpoint_of_another_model_is_refused_in_one_line(
    tmp_path: Path, resharded: tuple[Path, list[dict[str, State]]]
) -> None:
    root, _ = resharded
    checkpoint = root / "dp2-cp2-z3"
    before = {p: p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}
    wider = ModelConfig(preset="tiny", dim=48, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=SEQ)
    deeper = ModelConfig(preset="tiny", dim=32, n_layers=5, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=SEQ)
    shallower = ModelConfig(preset="tiny", dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=SEQ)
    for config, message in [(wider, r"holds 'tok_embeddings.weight' with shape \[256, 32\], this model's is \[256, 48\]"),
                            (deeper, r"holds no parameter 'layers.4."), (shallower, r"parameter elements, this model")]:
        engine = Engine(lambda: build_model(config, seed=0), lambda groups: torch.optim.AdamW(groups),
                        init(ParallelConfig(dp=1)), ParallelConfig(dp=1))
        with pytest.raises(UserError, match=message) as raised:
            engine.load(checkpoint)
        assert "\n" not in str(raised.value) and "another model" in str(raised.value)
    assert {p: p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()} == before


def test_a_missing_slice_is_named(tmp_path: Path, resharded: tuple[Path, list[dict[str, State]]]) -> None:
    root, _ = resharded
    copy = tmp_path / "copy"
    shutil.copytree(root / "dp2-cp2-z3", copy)
    step = next(copy.glob("step_*"))
    (step / "__1_0.distcp").unlink()
    engine = make_engine(init(ParallelConfig(dp=1)), ParallelConfig(dp=1))
    with pytest.raises(UserError, match=r"does not verify \(missing file __1_0.distcp\)"):
        engine.load(step)
    with pytest.raises(UserError, match=r"no checkpoint in .* verifies"):
        engine.load(copy)
    metadata = SafeReader(root / "dp2-cp2-z3" / step.name).read_metadata()
    split = [v for k, v in metadata.state_dict_metadata.items() if k.startswith(MODEL_KEY) and len(v.chunks) > 1]
    assert problems(engine, metadata, "X") is None
    split[0].chunks = split[0].chunks[:1]  # as if the rank writing the other chunks had not written them
    assert "(a rank's slices are missing)" in (problems(engine, metadata, "X") or "")
    metadata = SafeReader(root / "dp2-cp2-z3" / step.name).read_metadata()
    moments = [v for k, v in metadata.state_dict_metadata.items() if k.endswith(".exp_avg_sq") and len(v.chunks) > 1]
    moments[0].chunks = moments[0].chunks[1:]
    assert "lacks" in (problems(engine, metadata, "X") or "") and "the optimizer state of" in problems(engine, metadata, "X")


# ---- the command line: `ndtrain train` resumes under another layout; bad input is one line, exit 2 ----

def ndtrain_train(out: Path, data: str, steps: int, *more: str) -> tuple[int, str]:
    """`ndtrain train` on one process, in this process: (exit status, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(["train", "--nproc", "1", "--data", data, "--out", str(out), "--steps", str(steps),
                           "--save-every", "2", *CLI_TINY, *more])
    return status, err.getvalue()


# a warmup of 1 and a constant lr: the 2-step run resumed to 4 steps has the 4-step run's schedule (the default
# warmup, 30, capped at steps // 10 below a short run, and a decay over `steps` would differ between them)
CLI_TINY = ["--model", "tiny", "--set", "schedule.global_batch=8", "--set", "schedule.micro_batch=4",
            "--set", "log.progress=false", "--set", "data.eval_samples=8", "--set", "log.eval_every=0",
            "--warmup-steps", "1", "--lr-scheduler", "constant"]


def files(directory: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_train_resumes_under_another_layout_and_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    data = corpus_file(tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert ndtrain_train(straight, data, 4)[0] == 0
    assert ndtrain_train(resumed, data, 2)[0] == 0
    assert ndtrain_train(resumed, data, 4, "--zero", "3")[0] == 0  # FSDP resumes the zero=0 checkpoint
    assert json.loads((resumed / "summary.json").read_text())["resumed_from"] == 2
    model = build_model(load_config(None, {"model.preset": "tiny"}).model, 0)
    expected, actual = {}, {}
    for run, state in ((straight, expected), (resumed, actual)):
        load_model_weights(run / "checkpoints" / "step_00000004", model)
        state.update({k: v.detach().clone() for k, v in model.named_parameters()})
    assert_params_close(actual, expected, TOLERANCE, "zero=0 → zero=3 through ndtrain train")

    before = files(resumed / "checkpoints")
    for more, fragment in [(["--set", "schedule.global_batch=4"], "schedule.global_batch = 8, this run has 4"),
                           (["--set", "model.dim=48"], "it was written for another model"),
                           (["--optim", "sgd"], "holds the state of optim.name = adamw, this run uses sgd")]:
        status, err = ndtrain_train(resumed, data, 6, *more)
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and lines[0].startswith("ndtrain: error: "), err
        assert fragment in lines[0], lines[0]
    assert files(resumed / "checkpoints") == before  # nothing overwritten


def test_a_checkpoint_of_the_old_per_layout_format_is_refused_in_one_line(
    tmp_path: Path, resharded: tuple[Path, list[dict[str, State]]]
) -> None:
    root, _ = resharded
    copy = tmp_path / "old"
    shutil.copytree(root / "dp2-tp2-z1", copy)
    step = next(copy.glob("step_*"))
    progress = json.loads((step / "progress.json").read_text())
    del progress["checkpoint_format"]
    (step / "progress.json").write_text(json.dumps(progress))
    write_manifest(step, K, {})
    with pytest.raises(UserError, match=r"per-layout format .* \(model.init_from\)"):
        make_engine(init(ParallelConfig(dp=1)), ParallelConfig(dp=1)).load(copy)
