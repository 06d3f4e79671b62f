"""ZeRO-3 on a tensor-parallel model, and ZeRO-2/3 under pp with a tied embedding/head.

ZeRO-3 × tp: the FSDP units are built on the tp-sharded model, so each unit's flat buffer holds this
tp rank's slices (and the tp-replicated parameters) and is sharded further over dp. ZeRO-2/3 × pp
with a tied embedding/head: each stage's copy of the tied weight has its gradient reduce-scattered
into that stage's shards; the runner then sums the two copies' shards (pipeline/runner.py).

One spawn of 4 processes runs the FAST cases in turn (`run_each`: one failing case hides none) with
the float64 tiny Llama of tests/helpers/layouts.py, 2 micro-batches per rank, AdamW and clipping:
parameters after STEPS steps equal the single-process run (tests/helpers/reference.py; relative
error ≤ 1e-10, float64), as do the loss curve and the global gradient norm (each parameter counted
once over the world: tp slices once per tp rank, tp-replicated ones once, the tied head's copy
not at all). A resume case saves dp2×tp2 ZeRO-3 after K steps and continues it under dp4 ZeRO-0,
dp2×tp2 ZeRO-1 and the same layout: equal to the uninterrupted run within 1e-12 (float64), and
bit-identical under the same layout. SLOW: more layouts (4 processes), Hugging Face GPT-2 (tied
head) under dp2×pp2 ZeRO-2/3, and dp2×tp2×pp2 (8 processes).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from ndtrain.config import ParallelConfig
from ndtrain.engine import Engine
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.param_groups import no_decay_for_vectors
from tests.helpers.layouts import DTYPE, MAX_NORM, MODEL, STEPS, State, adamw, batch
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import Reference, decay_groups, train_reference
from tests.helpers.runner import Spawns, case_result, init_method, run_each

ACCUMULATION = 2
TOLERANCE = 1e-10  # float64: measured ≤ 3.7e-14 (HF GPT-2: 1.7e-12)
RESUME_TOLERANCE = 1e-12
LOSS_TOLERANCE = 1e-6  # the engine sums the reported loss in fp32
K = 2  # the resume case saves after K steps, of STEPS
TIED = replace(MODEL, tie_embeddings=True)

Layout = tuple[dict[str, Any], bool]  # (parallel config, tied embedding/head)
LAYOUTS: dict[str, Layout] = {
    "dp2-tp2-z3": (dict(dp=2, tp=2, zero=3), False),
    "dp2-tp2-sp-z3": (dict(dp=2, tp=2, sequence_parallel=True, zero=3), False),
    "dp2-pp2-z2-tied": (dict(dp=2, pp=2, zero=2), True),
    "dp2-pp2-z3-tied": (dict(dp=2, pp=2, zero=3), True),
    # slow, 4 processes
    "dp2-tp2-z3-keep-tied": (dict(dp=2, tp=2, zero=3, reshard_after_forward=False), True),
    "cp2-tp2-sp-z3": (dict(dp=1, cp=2, tp=2, sequence_parallel=True, zero=3), False),
    "tp2-pp2-z3-tied": (dict(dp=1, tp=2, pp=2, zero=3), True),
    "dp2-pp2-gpipe-z3-tied": (dict(dp=2, pp=2, pp_schedule="gpipe", zero=3), True),
    "dp2-pp2-vpp2-z3-tied": (dict(dp=2, pp=2, pp_schedule="interleaved", pp_virtual=2, zero=3), True),
    "dp2-pp2-zb-z2-tied": (dict(dp=2, pp=2, pp_schedule="zb", zero=2), True),
    # slow, 8 processes
    "dp2-tp2-pp2-z3": (dict(dp=2, tp=2, pp=2, zero=3), False),
    "dp2-tp2-pp2-z3-tied": (dict(dp=2, tp=2, pp=2, zero=3), True),
    "dp2-tp2-pp2-sp-z2-tied": (dict(dp=2, tp=2, pp=2, sequence_parallel=True, zero=2), True),
}
FAST = ["dp2-tp2-z3", "dp2-tp2-sp-z3", "dp2-pp2-z2-tied", "dp2-pp2-z3-tied"]
HF_GPT2 = {"gpt2-dp2-pp2-z2": dict(dp=2, pp=2, zero=2), "gpt2-dp2-pp2-z3": dict(dp=2, pp=2, zero=3)}  # tied head
SLOW = {4: ["dp2-tp2-z3-keep-tied", "cp2-tp2-sp-z3", "tp2-pp2-z3-tied", "dp2-pp2-gpipe-z3-tied", "dp2-pp2-vpp2-z3-tied",
            "dp2-pp2-zb-z2-tied", *HF_GPT2],
        8: ["dp2-tp2-pp2-z3", "dp2-tp2-pp2-z3-tied", "dp2-tp2-pp2-sp-z2-tied"]}
RESUMED = {"dp4-z0": dict(dp=4), "dp2-tp2-z1": dict(dp=2, tp=2, zero=1), "dp2-tp2-z3": dict(dp=2, tp=2, zero=3)}
SAVED = "dp2-tp2-z3"  # the FAST case whose checkpoint of step K the RESUMED layouts continue

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(layout: dict[str, Any], tied: bool) -> Engine:
    parallel = ParallelConfig(**layout)
    ctx = init(parallel, init_method=init_method())
    return Engine(lambda: build_model(TIED if tied else MODEL, seed=0).to(DTYPE), adamw, ctx, parallel,
                  group_fn=no_decay_for_vectors, grad_clip=MAX_NORM)


def _step(engine: Engine, step: int) -> Any:
    dp, rank = engine.ctx.size("dp"), engine.ctx.coord("dp")
    x, y = batch(step)
    x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
    return engine.train_step(list(zip(x.chunk(ACCUMULATION), y.chunk(ACCUMULATION))))


def _train(name: str, directory: str) -> dict[str, Any]:
    if name in HF_GPT2:
        return _train_gpt2(HF_GPT2[name])
    layout, tied = LAYOUTS[name]
    engine = _engine(layout, tied)
    losses, norms = [], []
    for step in range(STEPS):
        if name == SAVED and step == K:
            engine.save(f"{directory}/{name}")
        result = _step(engine, step)
        assert not result.skipped, (name, step)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    units = getattr(engine.dp.sharded_model, "units", [])
    return {"losses": losses, "norms": norms, "state": engine.full_state_dict(),
            "flat": sum(u.numel for u in units), "local": sum(p.numel() for p in engine.model.parameters()),
            "whole": engine.parameter_count}


def _train_gpt2(layout: dict[str, Any]) -> State:
    """The tiny HF GPT-2 of tests/helpers/hf.py (head tied to the token embedding), 2 micro-batches per rank."""
    from tests.helpers import hf

    parallel = ParallelConfig(**layout)
    engine = Engine(lambda: hf.make_model("gpt2"), hf.adamw, init(parallel, init_method=init_method()), parallel)
    dp, rank = engine.ctx.size("dp"), engine.ctx.coord("dp")
    for step in range(hf.STEPS):
        x, y = hf.batch(step)
        engine.train_step(list(zip(x.chunk(dp)[rank].chunk(ACCUMULATION), y.chunk(dp)[rank].chunk(ACCUMULATION))))
    return engine.full_state_dict()


def _resume(name: str, directory: str) -> State:
    """RESUMED layout `name` loads SAVED's checkpoint of step K and trains to STEPS."""
    engine = _engine(RESUMED[name], False)
    assert engine.load(f"{directory}/{SAVED}")["step"] == K
    for step in range(K, STEPS):
        _step(engine, step)
    return engine.full_state_dict()


@pytest.fixture(scope="module")
def spawns() -> Spawns:
    return Spawns(_world, timeout=600)


def _world(names: list[str], directory: str) -> dict[str, Any]:
    """In each worker: every case of `names`, then (with SAVED among them) every resume of its checkpoint."""
    out = run_each(lambda name: _train(name, directory), names)
    if SAVED in names:
        out.update(run_each(lambda key: _resume(key.split(":", 1)[1], directory), [f"resume:{b}" for b in RESUMED]))
    return out


def _results(spawns: Spawns, key: str | int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The spawn running FAST (`key` "fast", 4 processes) or SLOW[key] (`key` processes)."""
    names, world = (FAST, 4) if key == "fast" else (SLOW[key], key)
    return spawns.get(key, world, names, str(tmp_path_factory.getbasetemp() / f"sharded_tp_{key}"))


@pytest.fixture(scope="module")
def references() -> dict[bool, Reference]:
    """The single-process float64 runs over the same global batches, untied and tied."""
    out = {}
    for tied in (False, True):
        model = build_model(TIED if tied else MODEL, seed=0).to(DTYPE)
        out[tied] = train_reference(model, adamw(decay_groups(model)), [batch(s) for s in range(STEPS)],
                                    pieces=2 * ACCUMULATION, clip=MAX_NORM)
    return out


def _check(name: str, results: list[dict[str, Any]], references: dict[bool, Reference]) -> None:
    layout, tied = LAYOUTS[name]
    ref = references[tied]
    merged: State = {}
    for run in case_result(results, name):
        assert run["losses"] == pytest.approx(ref.losses, rel=LOSS_TOLERANCE), name
        # the global norm counts each parameter once: tp slices, tp-replicated ones, the tied weight
        assert run["norms"] == pytest.approx(ref.norms, rel=TOLERANCE), name
        if layout.get("zero") == 3 and layout.get("tp", 1) > 1:
            # the units flatten this rank's tp slices (and the replicated parameters): all of them, and
            # less than the whole model
            assert run["flat"] == run["local"] < run["whole"], name
        merged.update(run["state"])
    assert {t.dtype for t in merged.values()} == {DTYPE}, name
    error = assert_params_close(merged, ref.state, TOLERANCE, name)
    print(f"{name}: max relative error {error:.1e}")


@pytest.mark.parametrize("name", FAST)
def test_sharded_layouts_train_like_one_process(
    name: str, spawns: Spawns, references: dict[bool, Reference], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _check(name, _results(spawns, "fast", tmp_path_factory), references)


@pytest.mark.slow
@pytest.mark.parametrize("world, name", [(w, n) for w, names in SLOW.items() for n in names if n not in HF_GPT2])
def test_more_sharded_layouts_train_like_one_process(
    world: int, name: str, spawns: Spawns, references: dict[bool, Reference],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _check(name, _results(spawns, world, tmp_path_factory), references)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HF_GPT2))
def test_gpt2_tied_head_under_sharded_pipeline_trains_like_one_process(
    name: str, spawns: Spawns, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Hugging Face GPT-2's tied lm_head under dp2 × pp2 with ZeRO-2/3 (float64, bound 1e-10)."""
    pytest.importorskip("transformers")
    from tests.helpers import hf

    merged: State = {}
    for state in case_result(_results(spawns, 4, tmp_path_factory), name):
        merged.update(state)
    names = [n for n, _ in hf.make_model("gpt2").named_parameters()]  # the tied head's copy dropped
    error = assert_params_close({n: merged[n] for n in names}, hf.reference("gpt2", pieces=2 * ACCUMULATION),
                                TOLERANCE, name)
    print(f"{name}: max relative error {error:.1e}")


@pytest.mark.parametrize("layout", list(RESUMED))
def test_zero3_tp_checkpoint_resumes_under_another_layout(
    layout: str, spawns: Spawns, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """dp2×tp2 ZeRO-3 saved after K steps, continued under `layout`: the uninterrupted run's parameters."""
    results = _results(spawns, "fast", tmp_path_factory)
    expected: State = {}
    actual: State = {}
    for run, resumed in zip(case_result(results, SAVED), case_result(results, f"resume:{layout}")):
        expected.update(run["state"])
        actual.update(resumed)
    tolerance = 0.0 if layout == SAVED else RESUME_TOLERANCE
    error = assert_params_close(actual, expected, tolerance, f"{SAVED} -> {layout}")
    assert not math.isnan(error)
    print(f"{SAVED} -> {layout}: max relative error {error:.1e}")
