"""Retrieval evaluation: mAP/CMC against hand-computed and brute-force values, the uneven all-gather,
distributed evaluation equal (==) to single-process, and the digits task trained under DDP, ZeRO and
single-process DataParallel with parity against one process."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from ndtrain.config import ParallelConfig, load_config
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.eval.retrieval import LabeledSet, evaluate_retrieval, retrieval_metrics, similarity_scores, unit_codes
from ndtrain.dist.mesh import init
from ndtrain.models.digits import build_digits_model
from ndtrain.run.tasks import build_task
from ndtrain.trainer import Trainer, build_engine
from tests.helpers.parity import assert_params_close
from tests.helpers.runner import init_method, run_distributed

# ---------------------------------------------------------------------------------------- metrics


def test_hand_computed_example_with_ties_and_a_query_without_match() -> None:
    """Cosine ranking, ties by gallery index; the label-9 query has no match and is left out."""
    gallery = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])  # g0 and g1 tie for x-queries
    gallery_labels = torch.tensor([0, 1, 0, 1])
    query = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 5.0], [0.0, -1.0]])
    query_labels = torch.tensor([0, 1, 9, 1])
    # q0 (label 0): order g0 g1 g2 g3, hits at ranks 1 and 3: AP = (1/1 + 2/3) / 2 = 5/6, first match 1
    # q1 (label 1): same order, hits at 2 and 4: AP = (1/2 + 2/4) / 2 = 1/2, first match 2
    # q3 (label 1): similarities 0, 0, -1, 0 → order g0 g1 g3 g2, hits at 2 and 3: AP = (1/2 + 2/3) / 2 = 7/12
    m = retrieval_metrics(query, query_labels, gallery, gallery_labels, ranks=(1, 2, 5))
    assert m["map"] == pytest.approx(float((Fraction(5, 6) + Fraction(1, 2) + Fraction(7, 12)) / 3), abs=1e-15)
    assert (m["cmc1"], m["cmc2"], m["cmc5"]) == (pytest.approx(1 / 3, abs=1e-15), 1.0, 1.0)
    assert (m["queries"], m["queries_without_match"]) == (4, 1)
    # The tie rule decides: with g0 and g1 swapped, q0's first match drops to rank 2.
    swapped = retrieval_metrics(query[:1], query_labels[:1], gallery[[1, 0, 2, 3]], gallery_labels[[1, 0, 2, 3]])
    assert swapped["cmc1"] == 0.0 and swapped["map"] == pytest.approx((1 / 2 + 2 / 3) / 2, abs=1e-15)


def test_no_query_with_a_match_gives_nan() -> None:
    m = retrieval_metrics(torch.ones(2, 3), torch.tensor([1, 2]), torch.ones(3, 3), torch.tensor([0, 0, 0]))
    assert m["map"] != m["map"] and m["cmc1"] != m["cmc1"] and m["queries_without_match"] == 2


def test_a_non_finite_embedding_gives_nan() -> None:
    gallery = torch.ones(3, 2)
    gallery[1, 0] = float("nan")
    m = retrieval_metrics(torch.ones(2, 2), torch.tensor([0, 0]), gallery, torch.tensor([0, 0, 0]))
    assert m["map"] != m["map"] and m["cmc5"] != m["cmc5"] and m["queries_without_match"] == 2


def brute_force(query, query_labels, gallery, gallery_labels, ranks):  # type: ignore[no-untyped-def]
    """The module docstring's rule in plain Python: floats, integers and fractions, one pair at a time."""

    def code(vector: list[float]) -> list[int]:
        squares = 0.0
        for v in vector:
            squares += v * v
        norm = math.sqrt(squares)
        return [0 if norm == 0 else round(v / norm * 2**26) for v in vector]

    q_codes = [code(row) for row in query.double().tolist()]
    g_codes = [code(row) for row in gallery.double().tolist()]
    aps, firsts = [], []
    for i, qc in enumerate(q_codes):
        score = [sum(a * b for a, b in zip(qc, gc)) for gc in g_codes]
        order = sorted(range(len(g_codes)), key=lambda j: (-score[j], j))
        hits = [int(gallery_labels[j]) == int(query_labels[i]) for j in order]
        if not any(hits):
            continue
        found, precisions = 0, []
        for position, hit in enumerate(hits, start=1):
            if hit:
                found += 1
                precisions.append(Fraction(found / position))  # each precision a float64 quotient, summed exactly
        aps.append(float(sum(precisions)) / len(precisions))
        firsts.append(hits.index(True) + 1)
    out = {"map": float(sum(map(Fraction, aps))) / len(aps)}
    out.update({f"cmc{k}": sum(f <= k for f in firsts) / len(firsts) for k in ranks})
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_equal_brute_force_on_tied_embeddings(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    query = torch.randint(-2, 3, (17, 3), generator=g).float()   # few distinct values: many exact ties
    gallery = torch.randint(-2, 3, (29, 3), generator=g).float()
    query_labels, gallery_labels = torch.randint(0, 4, (17,), generator=g), torch.randint(0, 4, (29,), generator=g)
    got = retrieval_metrics(query, query_labels, gallery, gallery_labels, ranks=(1, 3, 5))
    want = brute_force(query, query_labels, gallery, gallery_labels, (1, 3, 5))
    assert {k: got[k] for k in want} == want


def tied_sets(seed: int = 3, n_query: int = 23, dim: int = 24) -> tuple[LabeledSet, LabeledSet]:
    """Heavy ties: a gallery of 13 vectors on a coarse grid, each also present as exact duplicates far
    apart and as column permutations (mathematically equal cosines against an all-equal query);
    queries on the same grid, two of them all-equal, one zero; labels from 4 classes."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-2, 3, (13, dim), generator=g).float() * 0.3
    permuted = [base[:, torch.randperm(dim, generator=g)] for _ in range(2)]
    gallery = torch.cat([base, permuted[0], base.flip(0), permuted[1], base])
    query = torch.cat([torch.randint(-2, 3, (n_query - 3, dim), generator=g).float() * 0.7, torch.full((2, dim), 0.1),
                       torch.zeros(1, dim)])
    labels = lambda n: torch.randint(0, 4, (n,), generator=g)
    return LabeledSet(query, labels(len(query))), LabeledSet(gallery, torch.cat([labels(13)] * 5))


def test_ties_are_exact_whatever_the_position_and_the_batching() -> None:
    """Exact duplicates and permuted copies score exactly equal against each query, the tie rule puts
    the lower gallery index first, and scoring 1, 2, ..., N queries at a time gives the brute force's
    value exactly."""
    query, gallery = tied_sets()
    q_codes, g_codes = unit_codes(query.inputs), unit_codes(gallery.inputs)
    scores = similarity_scores(q_codes, g_codes)
    base = scores[:, :13]
    assert torch.equal(scores[:, 52:65], base) and torch.equal(scores[:, 26:39], base.flip(1))
    all_equal = scores[-3:-1]  # the all-equal queries score a vector and its permutations alike
    assert torch.equal(all_equal[:, 13:26], all_equal[:, :13]) and torch.equal(all_equal[:, 39:52], all_equal[:, :13])
    for i in range(len(query.labels)):  # one query at a time, row by row: the same integers
        assert torch.equal(similarity_scores(q_codes[i : i + 1], g_codes), scores[i : i + 1])
    # The data are sensitive: the plain float64 cosine, summed in index order, splits some of these ties.
    unit = lambda v: [x / math.sqrt(sum(y * y for y in v)) for x in v]
    q = unit(query.inputs[-2].double().tolist())
    plain = [sum(a * b for a, b in zip(q, unit(gallery.inputs[j].double().tolist()))) for j in (1, 14)]
    assert plain[0] != plain[1]  # one ULP apart: a ranking on them would depend on the arithmetic's order
    want = brute_force(query.inputs, query.labels, gallery.inputs, gallery.labels, CMC_RANKS)
    assert 0 < want["map"] < 1 and want["cmc1"] < 1
    for batch in range(1, len(query.labels) + 1):
        got = retrieval_metrics(*query, *gallery, ranks=CMC_RANKS, query_batch=batch)
        assert {k: got[k] for k in want} == want, batch
        assert (got["queries"], got["queries_without_match"]) == (23, 0)


# --------------------------------------------------------------------------------- uneven gather

SHARD_ROWS = {1: [3], 2: [0, 4], 3: [2, 0, 3]}
SET_SIZES = [(13, 22), (2, 31)]  # (2, 31) on 3 ranks: one rank has no query
CMC_RANKS = (1, 2, 3, 5)
TIED_QUERY_BATCHES = (1, 2, 7, 23)


def elementwise_embed(x: torch.Tensor) -> torch.Tensor:
    """Batch-independent: every rank computes bit-identical embeddings for the same samples."""
    return torch.sin(3 * x) + x * x


def retrieval_sets(n_query: int, n_gallery: int) -> tuple[LabeledSet, LabeledSet]:
    g = torch.Generator().manual_seed(7)
    make = lambda n: LabeledSet(torch.randint(-3, 4, (n, 4), generator=g).float() / 2, torch.randint(0, 5, (n,), generator=g))
    return make(n_query), make(n_gallery)


def _collectives(ctx) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """On each rank: three uneven gathers (with the counters they left), then the retrieval of each SET_SIZES."""
    g = ctx.group("world")
    mine = SHARD_ROWS[g.size][g.rank]
    floats = torch.arange(mine * 2, dtype=torch.float32).reshape(mine, 2) + 100 * g.rank
    ints = torch.full((mine,), g.rank, dtype=torch.int64)
    gathered = [ctx.comm.all_gather_uneven(t, g) for t in (floats, ints, torch.zeros(0, 5))]
    out: dict[str, object] = {"gathered": gathered, "stats": ctx.comm.stats.snapshot(), "issued": dict(ctx.comm.issued)}
    for sizes in SET_SIZES:
        calls: list[int] = []
        embed = lambda x: calls.append(len(x)) or elementwise_embed(x)
        metrics = evaluate_retrieval(embed, *retrieval_sets(*sizes), ctx, batch_size=4, ranks=CMC_RANKS)
        out[f"retrieval{sizes}"] = (metrics, len(calls))
    tied = tied_sets()
    out["tied"] = [evaluate_retrieval(lambda x: x, *tied, ctx, batch_size=5, ranks=CMC_RANKS, query_batch=b)
                   for b in TIED_QUERY_BATCHES]
    return out


def _collectives_worker() -> dict[str, object]:
    return _collectives(init(ParallelConfig(), init_method=init_method()))


@functools.cache
def collective_results(world: int) -> list[dict[str, object]]:
    """Per rank, what `_collectives` returned: one spawn of `world` processes serves every test below."""
    if world == 1:
        return [_collectives(init(ParallelConfig(dp=1)))]
    return run_distributed(_collectives_worker, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_uneven_all_gather_concatenates_in_rank_order(world: int) -> None:
    rows = SHARD_ROWS[world]
    want_floats = torch.cat([torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + 100 * r for r, n in enumerate(rows)])
    want_ints = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, n in enumerate(rows)])
    longest = max(rows)
    for result in collective_results(world):
        floats, ints, empty = result["gathered"]
        assert torch.equal(floats, want_floats) and torch.equal(ints, want_ints)
        assert empty.shape == (0, 5)
        if world == 1:
            assert result["stats"] == {}  # a group of one is a no-op that counts nothing
            continue
        entry = result["stats"]["all_gather_uneven/world"]
        assert entry["calls"] == 5  # sizes + rows for two gathers, sizes only for the all-empty one
        sizes_wire = 3 * (world - 1) * 8
        rows_wire = (world - 1) * longest * (2 * 4 + 8)  # float32 rows of 2, int64 rows of 1
        assert entry["wire_bytes"] == sizes_wire + rows_wire
        assert result["issued"]["world"] == 5


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("sizes", SET_SIZES)
def test_distributed_retrieval_equals_single_process_exactly(world: int, sizes: tuple[int, int]) -> None:
    query, gallery = retrieval_sets(*sizes)
    reference = retrieval_metrics(elementwise_embed(query.inputs), query.labels, elementwise_embed(gallery.inputs),
                                  gallery.labels, ranks=CMC_RANKS)
    assert 0 < reference["map"] < 1  # not a trivial case
    results = [result[f"retrieval{sizes}"] for result in collective_results(world)]
    for metrics, _ in results:
        assert metrics == reference  # exact: same embeddings, same order, same arithmetic
    assert len({calls for _, calls in results}) == 1  # every rank embedded in lockstep (ZeRO-3 needs it)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_distributed_retrieval_on_ties_gives_the_documented_value(world: int) -> None:
    """The duplicated, permuted gallery at 1, 2 and 3 processes, queries scored 1, 2, 7 and 23 at a
    time: every rank, every batching equals the brute force exactly."""
    query, gallery = tied_sets()
    want = brute_force(query.inputs, query.labels, gallery.inputs, gallery.labels, CMC_RANKS)
    for result in collective_results(world):
        for batch, metrics in zip(TIED_QUERY_BATCHES, result["tied"]):
            assert {k: metrics[k] for k in want} == want, (world, batch)


# ------------------------------------------------------------------------------- digits task


def digits_config(out: str, **overrides: object):  # type: ignore[no-untyped-def]
    base = {"model.preset": "digits", "log.out": out, "log.progress": False, "schedule.steps": 4,
            "schedule.global_batch": 16, "schedule.micro_batch": 4, "schedule.warmup_steps": 1, "log.eval_every": 2,
            "log.log_every": 1}
    base.update(overrides)
    return load_config(None, base)


class Float64Trainer(Trainer):
    """The digits model in float64, so that parity measures the layouts, not the CPU kernels' summation
    order (in fp32 AdamW amplifies it to ~4e-5 after 4 steps); the run is otherwise the CLI's."""

    def make_engine(self) -> Engine:
        return build_engine(self.cfg, self.ctx, lambda: self.task.model_fn().double())


def train_digits(cfg) -> tuple[dict[str, torch.Tensor], dict[str, object]]:  # type: ignore[no-untyped-def]
    ctx = init(cfg.parallel, init_method=init_method()) if cfg.parallel.dp != 1 else init(cfg.parallel)
    trainer = Float64Trainer(cfg, ctx)
    summary = trainer.run()
    return trainer.engine.full_state_dict(), summary


def test_digits_preset_brings_its_defaults_below_explicit_keys() -> None:
    cfg = load_config(None, {"model.preset": "digits", "schedule.steps": 7})
    assert (cfg.model.dim, cfg.schedule.steps, cfg.schedule.global_batch, cfg.data.eval_samples) == (64, 7, 64, 0)
    assert load_config(None, {}).schedule.global_batch == 32  # other presets keep the general defaults
    for refused in ({"parallel.tp": 2}, {"ps.servers": 1}, {"data.path": __file__}):
        with pytest.raises(UserError, match="data parallelism only"):
            load_config(None, {"model.preset": "digits", **refused})


def test_missing_scikit_learn_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails as if not installed
    with pytest.raises(UserError, match=r"pip install 'ndtrain\[vision\]'"):
        build_task(load_config(None, {"model.preset": "digits"}))


LAYOUTS = {"ddp": {}, "zero1": {"parallel.zero": 1}, "zero3": {"parallel.zero": 3}}


def _digits_worker(root: str) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, object]]]:
    return {name: train_digits(digits_config(f"{root}/{name}", **more)) for name, more in LAYOUTS.items()}


def test_digits_trains_under_ddp_and_zero_like_one_process(tmp_path: Path, one_thread: None) -> None:
    reference, ref_summary = train_digits(digits_config(str(tmp_path / "one"), **{"parallel.dp": 1}))
    ranks = run_distributed(_digits_worker, 2, str(tmp_path))
    initial = {k: v.detach().double() for k, v in build_digits_model(64, 0).state_dict().items()}
    moved = max(((reference[k] - initial[k]).abs().max() / initial[k].abs().max()).item() for k in initial)
    assert moved > 1e-3  # training moved the weights: the parity check can fail
    for name in LAYOUTS:
        for rank in range(2):
            params, summary = ranks[rank][name]
            assert_params_close(params, reference, 1e-5, f"{name} rank {rank}")
            for key in ("map", "cmc1", "cmc5"):  # embeddings equal to ~1e-12: the same ranking
                assert summary[key] == pytest.approx(ref_summary[key], abs=1e-9), (name, key)
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics if "map" in m] == [2, 4]
        assert all(0 <= m[k] <= 1 for m in metrics if "map" in m for k in ("map", "cmc1", "cmc5"))
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["unit"] == "images" and summary["tokens"] == 4 * 16 and "cmc5" in summary


def test_digits_single_process_data_parallel_equals_one_device(tmp_path: Path, one_thread: None) -> None:
    one, one_summary = train_digits(digits_config(str(tmp_path / "one"), **{"parallel.dp": 1}))
    replicated, summary = train_digits(digits_config(
        str(tmp_path / "three"), **{"parallel.dp": 1, "parallel.dp_mode": "single-process", "parallel.replicas": 3}))
    assert_params_close(replicated, one, 1e-5, "single-process DataParallel")
    for key in ("map", "cmc1", "cmc5"):
        assert summary[key] == pytest.approx(one_summary[key], abs=1e-9), key


def test_cli_digits_single_process_data_parallel(tmp_path: Path) -> None:
    """`ndtrain train --model digits` in one process over 2 replicas (the 2-process CLI run is the slow test)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ndtrain", "train", "--model", "digits", "--nproc", "1", "--dp-mode", "single-process",
         "--steps", "3", "--out", str(out), "--set", "log.progress=false", "--set", "launch.threads=1"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cmc1" in proc.stdout and "images/s" in proc.stdout and "nats/byte" not in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["unit"] == "images" and 0 <= summary["cmc1"] <= 1
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "cmc5" in m] == [3]


@pytest.mark.slow
def test_default_digits_run_reaches_rank1_095(tmp_path: Path) -> None:
    """The default `ndtrain train --model digits` (2 processes, 150 steps): rank-1 on the held-out test split."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "train", "--model", "digits", "--out", str(out),
                           "--set", "log.progress=false"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cmc1" in proc.stdout and "images/s" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["test_cmc1"] >= 0.95, summary
