"""Validation perplexity and next-token accuracy (eval/token_metrics.py): equal to a hand computation from
the single-process logits, and to it under dp2, dp2 with ZeRO-3, tp2 (a vocab-parallel head: the argmax
combined over the shards), tp2 with sequence parallelism, pp2 (counted on the last stage) and cp2
(each rank's sequence shard), for the built-in Llama and an HF Llama behind the CausalLM adapter.

The targets of the evaluation batch are the reference model's own argmax at every other position
(random tokens elsewhere), so the accuracy is near one half, not the ~1/256 of an untrained model,
and a layout that miscounts (a shard counted twice, a stage's zeros, the wrong column offset) moves it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import ParallelConfig
from ndtrain.dist.mesh import init
from ndtrain.engine import Engine
from ndtrain.eval.token_metrics import IGNORE_INDEX, Evaluation, correct_predictions, scoring
from ndtrain.models.llama import build_model
from ndtrain.parallel.model.vocab import VocabParallelCrossEntropy
from tests.helpers.layouts import DTYPE, MODEL, adamw, batch
from tests.helpers.runner import case_result, init_method, run_distributed, run_each

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": dict(dp=2), "dp2-zero3": dict(dp=2, zero=3), "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2), "cp2": dict(cp=2),
}
HF_LAYOUTS: dict[str, dict[str, Any]] = {"hf-tp2": dict(tp=2), "hf-pp2": dict(pp=2)}

pytestmark = pytest.mark.usefixtures("one_thread")


def llama() -> torch.nn.Module:
    return build_model(MODEL, seed=0).to(DTYPE)


def hf_llama() -> torch.nn.Module:
    from tests.helpers.hf import make_model

    return make_model("llama")


def hf_batch() -> tuple[torch.Tensor, torch.Tensor]:
    from tests.helpers.hf import batch as hf_tokens

    return hf_tokens(7)


@functools.cache
def eval_batch(hf: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets: the model's own argmax at even positions, the random next token at odd ones."""
    model, (x, y) = (hf_llama(), hf_batch()) if hf else (llama(), batch(7))
    with torch.no_grad():
        predicted = model(x).argmax(dim=-1)
    even = torch.arange(y.shape[1]) % 2 == 0
    return x, torch.where(even, predicted, y)


def by_hand(hf: bool) -> tuple[float, float, float]:
    """Mean loss, perplexity and accuracy from the single-process logits."""
    model = hf_llama() if hf else llama()
    x, y = eval_batch(hf)
    with torch.no_grad():
        logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    return loss, math.exp(loss), (logits.argmax(-1) == y).double().mean().item()


def _evaluate(name: str) -> dict[str, Any]:
    hf = name.startswith("hf-")
    layout = (HF_LAYOUTS if hf else LAYOUTS)[name]
    parallel = ParallelConfig(**layout)
    ctx = init(parallel, init_method=init_method())
    engine = Engine(hf_llama if hf else llama, adamw, ctx, parallel)
    x, y = eval_batch(hf)
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    evaluation = engine.evaluate([(x.chunk(dp)[rank], y.chunk(dp)[rank])])
    return {"evaluation": evaluation}


def _tied_argmax() -> dict[str, Any]:
    """Vocabulary 7 over tp2 (shards of 4: one padding column): equal maxima on both shards go to the
    lowest global index; a target of -100 is never counted."""
    ctx = init(ParallelConfig(tp=2), init_method=init_method())
    tp_rank = ctx.coord("tp")
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0, 5.0, 2.0, 5.0],   # ties at 1, 3, 4, 6 → 1
                           [0.0, 1.0, 1.0, 2.0, 9.0, 9.0, 3.0],   # ties at 4, 5 (rank 1) → 4
                           [7.0, 1.0, 1.0, 2.0, 0.0, 0.0, 3.0],   # max on rank 0 → 0
                           [0.0, 1.0, 1.0, 2.0, 0.0, 0.0, 3.0]])  # target ignored
    targets = torch.tensor([1, 4, 0, IGNORE_INDEX])
    padded = torch.cat([logits, torch.full((4, 1), 100.0)], dim=1)  # a padding column never wins
    shard = padded[:, 4 * tp_rank: 4 * tp_rank + 4]
    loss = VocabParallelCrossEntropy(4 * tp_rank, 7, ctx.comm, ctx.group("tp"))
    return {"correct": int(loss.correct(shard, targets)), "whole": int(correct_predictions(logits, targets))}


def _workers() -> dict[str, Any]:
    return {**run_each(_evaluate, [*LAYOUTS, *HF_LAYOUTS]), **run_each(lambda _: _tied_argmax(), ["tie"])}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_workers, 2, timeout=300)


def test_single_process_evaluation_equals_the_hand_computation() -> None:
    x, y = eval_batch(False)
    engine = Engine(llama, adamw, init(ParallelConfig()), ParallelConfig())
    evaluation = engine.evaluate([(x[:3], y[:3]), (x[3:], y[3:])])
    loss, ppl, accuracy = by_hand(False)
    assert 0.3 < accuracy < 0.7  # the batch makes the accuracy informative
    assert evaluation.tokens == y.numel()
    assert evaluation.loss == pytest.approx(loss, rel=1e-12)
    assert evaluation.perplexity == pytest.approx(ppl, rel=1e-12)
    assert evaluation.accuracy == pytest.approx(accuracy, abs=1e-15)
    assert evaluation.record() == {"val_loss": evaluation.loss, "val_ppl": evaluation.perplexity,
                                   "val_accuracy": evaluation.accuracy}


@pytest.mark.parametrize("name", [*LAYOUTS, *HF_LAYOUTS])
def test_layout_evaluates_like_one_process(name: str, runs: list[dict[str, Any]]) -> None:
    hf = name.startswith("hf-")
    loss, ppl, accuracy = by_hand(hf)
    assert 0.3 < accuracy < 0.7
    for result in case_result(runs, name):
        evaluation: Evaluation = result["evaluation"]
        assert evaluation.tokens == eval_batch(hf)[1].numel()
        assert evaluation.loss == pytest.approx(loss, rel=1e-6)  # the pipeline's loss crosses stages in float32
        assert evaluation.perplexity == pytest.approx(ppl, rel=1e-6)
        assert evaluation.accuracy == pytest.approx(accuracy, abs=1e-15)


def test_vocab_parallel_argmax_breaks_ties_to_the_lowest_index(runs: list[dict[str, Any]]) -> None:
    for result in case_result(runs, "tie"):
        assert result == {"correct": 3, "whole": 3}


def test_ignored_targets_are_not_counted_and_seams_are_restored() -> None:
    model = llama()
    x, y = eval_batch(False)
    y = y.clone()
    y[:, ::4] = IGNORE_INDEX
    with torch.no_grad():
        logits = model(x)
        with scoring(model) as tally:
            model(x, y)
        correct, counted = tally.take(torch.device("cpu")).tolist()
    kept = y != IGNORE_INDEX
    assert counted == kept.sum().item()
    assert correct == ((logits.argmax(-1) == y) & kept).sum().item() > 0
    assert "loss_fn" not in model.__dict__  # the class's seam again


def test_a_model_without_the_seam_has_no_accuracy() -> None:
    assert Evaluation(loss=1.0, tokens=3, accuracy=None).record() == {"val_loss": 1.0}
    assert Evaluation(loss=1000.0, tokens=3, accuracy=0.5).perplexity == math.inf
