"""Pipeline schedules as data, stage balancing, and the single-rank (pp=1) path, in one process."""

from __future__ import annotations

import pytest
import torch

from ndtrain.config import ModelConfig, ParallelConfig
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.parallel.pipeline import run_pipeline, split_model
from ndtrain.parallel.pipeline.partition import balanced_split
from ndtrain.parallel.pipeline.schedules import (
    SCHEDULES, Action, build, bubble_fraction, check, compute_actions, place, simulate, stage_of,
)

CASES = [(s, p, m, v) for p in (1, 2, 3, 4, 5) for m in (p, 2 * p, 3 * p + (p > 1)) for s, v in
         [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 3)]
         if not (s == "interleaved" and m % p)]


pytestmark = pytest.mark.usefixtures("one_thread")


def closed_form(schedule: str, p: int, m: int, v: int) -> float:
    if schedule == "naive":
        return (p - 1) / p
    if schedule == "zb":  # t_F = t_I = t_W
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_schedule_runs_every_pass_once_without_deadlock_at_its_theoretical_bubble(
    schedule: str, p: int, m: int, v: int
) -> None:
    compute = compute_actions(schedule, p, m, v)
    kinds = ("F", "I", "W") if schedule == "zb" else ("F", "B")
    for r, actions in enumerate(compute):
        assert sorted(map(repr, actions)) == sorted(repr(Action(k, i, c)) for k in kinds for i in range(m) for c in range(v))
    times = simulate(compute, p, v, lambda kind, stage: 1.0)
    if p > 1:
        assert bubble_fraction(times) == pytest.approx(closed_form(schedule, p, m, v))


@pytest.mark.parametrize("schedule,p,m,v", [c for c in CASES if c[1] > 1])
def test_every_send_has_its_receive(schedule: str, p: int, m: int, v: int) -> None:
    plans = build(schedule, p, m, v)
    sent, received = set(), set()
    for r, actions in enumerate(plans):
        for a in actions:
            s = stage_of(r, a.chunk, p)
            if a.kind.startswith("SEND"):
                sent.add((a.kind[-1], a.mb, s + 1 if a.kind == "SEND_F" else s - 1))
            elif a.kind.startswith("RECV"):
                received.add((a.kind[-1], a.mb, s))
    assert sent == received
    assert len(sent) == 2 * m * (p * v - 1)


def test_gpipe_and_1f1b_live_activations() -> None:
    def peaks(schedule: str) -> list[int]:
        out = []
        for actions in compute_actions(schedule, 4, 8):
            live = peak = 0
            for a in actions:
                live += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
                peak = max(peak, live)
            out.append(peak)
        return out

    assert peaks("gpipe") == [8, 8, 8, 8]
    assert peaks("1f1b") == [4, 3, 2, 1]
    assert peaks("zb") == [4, 4, 4, 4]


@pytest.mark.parametrize("schedule,p,m,v,words", [
    ("1f1b", 4, 3, 1, "m >= p"), ("zb", 2, 1, 1, "m >= p"), ("interleaved", 4, 6, 2, "multiple of p=4"),
    ("gpipe", 2, 4, 2, "interleaved"), ("pipedream", 2, 4, 1, "unknown"), ("gpipe", 2, 0, 1, "at least one"),
])
def test_bad_schedule_input(schedule: str, p: int, m: int, v: int, words: str) -> None:
    with pytest.raises(UserError, match=words):
        check(schedule, p, m, v)


def test_balanced_split() -> None:
    assert balanced_split([1.0] * 6, 4) == [2, 2, 1, 1]
    assert balanced_split([1.0] * 6, 4, first_extra=1.0, last_extra=1.0) == [1, 2, 2, 1]
    assert balanced_split([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == [1, 5]
    assert balanced_split([1.0, 1.0, 1.0], 3) == [1, 1, 1]
    assert place(stage_of(3, 1, 4), 4) == (3, 1)


def _tiny(layers: int, tied: bool) -> ModelConfig:
    return ModelConfig(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, seq_len=8,
                       tie_embeddings=tied)


@pytest.mark.parametrize("schedule,virtual,balance", [("interleaved", 3, "params"), ("zb", 1, "measured")])
def test_single_rank_pipeline_equals_the_model(schedule: str, virtual: int, balance: str) -> None:
    """pp=1: stages hand over locally (no communication); a tied weight is one parameter."""
    ctx = init(ParallelConfig())
    cfg = _tiny(4, tied=True)
    g = torch.Generator().manual_seed(0)
    batches = [(t[:, :-1], t[:, 1:]) for t in torch.randint(0, 64, (3, 2, 9), generator=g)]
    reference = build_model(cfg, 1)
    losses = [reference(x, y) for x, y in batches]
    (sum(losses) / 3).backward()
    stages = split_model(build_model(cfg, 1), ctx, virtual=virtual, balance=balance)
    assert len(stages) == virtual
    loss = run_pipeline(stages, batches, ctx, schedule)
    assert loss.item() == pytest.approx(sum(l.item() for l in losses) / 3, rel=1e-6)  # the mean over micro-batches
    want = dict(reference.named_parameters())
    want["output.weight"] = want["tok_embeddings.weight"]  # on one rank the stages share the tensor
    got = {n: q for s in stages for n, q in s.named_parameters()}
    assert set(got) | {"output.weight"} == set(want)  # one stage lists the shared tensor once
    for name, q in got.items():
        err = ((q.grad - want[name].grad).norm() / want[name].grad.norm()).item()
        assert err <= 1e-5, f"{name}: {err:.2e}"


def test_every_configurable_schedule_has_a_rank_schedule() -> None:
    """The schedule names are options.PipelineSchedule's; the table of rank schedules has exactly them."""
    from ndtrain.config.options import PipelineSchedule, values
    from ndtrain.parallel.pipeline.schedules import _RANK_SCHEDULES

    assert tuple(_RANK_SCHEDULES) == values(PipelineSchedule) == SCHEDULES


def test_too_few_layers_for_the_stages() -> None:
    ctx = init(ParallelConfig())
    with pytest.raises(UserError, match="3 layers cannot fill 4 pipeline stages"):
        split_model(build_model(_tiny(3, False), 0), ctx, virtual=4)
    with pytest.raises(UserError, match="loss_fn"):
        split_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), ctx)


@pytest.mark.parametrize("last", [False, True])
def test_split_backward_equals_full_backward(last: bool) -> None:
    """zb's I then W: the input gradient and every weight gradient of one backward, with W
    restarting only at the weights' own operations (the split is complete for a Llama stage)."""
    from ndtrain.models.llama_parallel import LlamaStage
    from ndtrain.parallel.pipeline.split_backward import WeightPasses

    model = build_model(_tiny(3, False), 2)
    stage = LlamaStage(model, [1, 2], first=False, last=last)
    params = list(stage.parameters())
    x0 = torch.randn(2, 8, 32)
    targets = torch.randint(0, 64, (2, 8))
    grad = None if last else torch.randn(2, 8, 32)
    x = x0.clone().requires_grad_()
    torch.autograd.backward(stage(x, targets), grad)
    want_x, want = x.grad, [q.grad.clone() for q in params]
    stage.zero_grad(set_to_none=True)

    x = x0.clone().requires_grad_()
    out = stage(x, targets)
    passes = WeightPasses(out, params)
    (gx,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
    passes.input_pass_done()
    assert passes.complete and len(passes.boundary) >= 7 * 2
    assert all(q.grad is None for q in params)  # I computed no weight gradient
    passes.run()
    assert torch.allclose(gx, want_x, rtol=1e-5, atol=1e-7)
    for q, w in zip(params, want):
        assert torch.allclose(q.grad, w, rtol=1e-5, atol=1e-7)
