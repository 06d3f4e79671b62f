"""Single-process data parallel over CPU "devices" (real threads) vs the single-device module."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from ndtrain.config import config_from_dict
from ndtrain.errors import UserError
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.single_process import ReplicaError, SingleProcessDataParallel, chunk_sizes
from tests.helpers.parity import assert_params_close, max_relative_error
from tests.helpers.runs import corpus_file, tiny_config, train

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class MLPLoss(nn.Module):
    """A small MLP; forward(x, y) returns the mean squared error over the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def tiny_llama(**model: object) -> nn.Module:
    return build_model(config_from_dict({"model": {"preset": "tiny", **model}}).model, seed=0)


def mlp_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def llama_batch(n: int, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    v, t = model.cfg.vocab_size, 16
    return torch.randint(0, v, (n, t), generator=g), torch.randint(0, v, (n, t), generator=g)


def check_parity(make_model, make_batch, n: int, k: int, steps: int = 5) -> None:
    ref = make_model()
    model = copy.deepcopy(ref)
    dp = SingleProcessDataParallel(model, ["cpu"] * k)
    batch = make_batch(n, ref)
    # Loss and gradients of the first step.
    ref_loss = ref(*batch)
    loss = dp(*batch)
    assert loss.dim() == 0
    assert rel_err(loss.detach(), ref_loss.detach()) <= TOL
    ref_loss.backward()
    loss.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert q.grad is not None, name
        assert rel_err(q.grad, p.grad) <= TOL, name
    # Several AdamW steps (the first reuses the gradients above).
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-2)
    for step in range(steps):
        if step > 0:
            batch = make_batch(n, ref)
            ref(*batch).backward()
            dp(*batch).backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert rel_err(q.detach(), p.detach()) <= TOL, name
    # The check can fail: the parameters did move.
    assert any(rel_err(q.detach(), p.detach()) > 1e-3 for p, q in zip(make_model().parameters(), model.parameters()))


@pytest.mark.parametrize("k,n", [(2, 8), (3, 9), (3, 7)])
def test_mlp_parity(k: int, n: int) -> None:
    check_parity(lambda: MLPLoss(), lambda n, _m: mlp_batch(n), n, k)


@pytest.mark.parametrize("k,n", [(2, 4), (3, 7)])
def test_llama_parity(k: int, n: int) -> None:
    check_parity(tiny_llama, llama_batch, n, k)


def test_llama_tied_embeddings_parity() -> None:
    """A parameter used twice (embedding = output head) gets one copy per replica, stays tied."""
    check_parity(lambda: tiny_llama(tie_embeddings=True), llama_batch, 5, 2)


def test_chunk_sizes() -> None:
    assert chunk_sizes(7, 3) == [3, 2, 2]
    assert chunk_sizes(9, 3) == [3, 3, 3]
    assert chunk_sizes(5, 2) == [3, 2]


class Recorder(nn.Module):
    """Returns per-item outputs; records the chunk sizes and the thread of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.calls: list[tuple[int, str, str]] = []
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor, scale: float, extra: dict) -> dict:
        with self.lock:
            self.calls.append((x.shape[0], threading.current_thread().name, extra["tag"]))
        return {"out": self.lin(x) * scale, "tag": extra["tag"], "pair": (x.sum(), x[:, :1])}


def test_uneven_batch_outputs_concatenated_and_threads_used() -> None:
    torch.manual_seed(0)
    m = Recorder()
    dp = SingleProcessDataParallel(m, ["cpu", "cpu", "cpu"])
    x = torch.randn(7, 3)
    out = dp(x, 2.0, extra={"tag": "t"})
    expected = m.lin(x) * 2.0
    assert out["out"].shape == (7, 2)
    torch.testing.assert_close(out["out"], expected, rtol=TOL, atol=1e-6)
    assert out["tag"] == "t"
    torch.testing.assert_close(out["pair"][1], x[:, :1])
    # A 0-dim output is combined as the chunk-size-weighted mean: sum(x) chunks → sum(x)/... rule.
    sizes = [3, 2, 2]
    chunks = x.split(sizes)
    torch.testing.assert_close(out["pair"][0], sum(c.sum() * n / 7 for c, n in zip(chunks, sizes)))
    assert sorted(c[0] for c in m.calls) == [2, 2, 3]
    assert sorted(c[1] for c in m.calls) == ["replica-0-cpu", "replica-1-cpu", "replica-2-cpu"]  # real threads
    # Gradients through the concatenated outputs match the whole-batch module.
    out["out"].pow(2).sum().backward()
    g = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    expected.pow(2).sum().backward()
    for a, p in zip(g, m.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=TOL, atol=1e-6)


def test_no_grad_forward() -> None:
    dp = SingleProcessDataParallel(MLPLoss(), ["cpu", "cpu"])
    with torch.no_grad():
        loss = dp(*mlp_batch(4))
    assert not loss.requires_grad


class Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x < 0).any():
            raise ValueError("negative input")
        return self.lin(x)


def test_exception_in_replica_names_device() -> None:
    dp = SingleProcessDataParallel(Failing(), ["cpu", "cpu", "cpu"])
    x = torch.ones(6, 2)
    x[5] = -1.0  # only in the last chunk (replica 2)
    with pytest.raises(ReplicaError, match=r"replica 2 on device cpu failed: ValueError: negative input") as info:
        dp(x)
    assert isinstance(info.value.__cause__, ValueError)


def test_bad_inputs() -> None:
    with pytest.raises(UserError, match="empty"):
        SingleProcessDataParallel(MLPLoss(), [])
    with pytest.raises(UserError, match="mix device types"):
        SingleProcessDataParallel(MLPLoss(), ["cpu", "meta"])
    with pytest.raises(UserError, match="list of devices"):
        SingleProcessDataParallel(MLPLoss(), "cpu")
    with pytest.raises(UserError, match="not a valid torch device"):
        SingleProcessDataParallel(MLPLoss(), ["cpu", "nodevice"])
    with pytest.raises(UserError, match="devices\\[0\\] is meta"):
        SingleProcessDataParallel(MLPLoss(), ["meta"])
    dp = SingleProcessDataParallel(MLPLoss(), ["cpu"] * 3)
    with pytest.raises(UserError, match="batch size 2 is smaller than the 3 devices"):
        dp(*mlp_batch(2))
    x, y = mlp_batch(4)
    with pytest.raises(UserError, match="disagree on dim 0"):
        dp(x, y[:3])
    with pytest.raises(UserError, match="no tensor"):
        dp(1.0, 2.0)


def test_single_device_is_the_module() -> None:
    ref = MLPLoss()
    dp = SingleProcessDataParallel(copy.deepcopy(ref), ["cpu"])
    batch = mlp_batch(3)
    assert torch.equal(dp(*batch), ref(*batch))


def test_trainer_single_process_mode_equals_single_device(tmp_path) -> None:
    """`--dp-mode single-process`: the Engine runs the model on 3 CPU replicas; same training result."""
    from ndtrain.trainer import Trainer

    data = corpus_file(tmp_path)
    common = {"parallel.dp": 1, "schedule.micro_batch": 4}
    single = train(tiny_config(data, str(tmp_path / "one"), **common), torch.float64)
    cfg = tiny_config(data, str(tmp_path / "three"), **common, **{"parallel.dp_mode": "single-process", "parallel.replicas": 3})
    replicated = train(cfg, torch.float64)
    assert_params_close(replicated, single, TOL, "3 replicas")
    initial = {k: v.detach() for k, v in tiny_llama().state_dict().items()}
    assert max_relative_error(initial, single) > 1e-3  # training moved the weights: the check can fail
    from ndtrain.dist.mesh import init

    engine = Trainer(cfg, init(cfg.parallel)).engine
    assert isinstance(engine.wrapped.module, SingleProcessDataParallel) and len(engine.wrapped.module.devices) == 3


def test_cli_dp_mode_single_process(tmp_path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ndtrain", "train", "--dp-mode", "single-process", "--nproc", "1", "--model", "tiny",
         "--steps", "2", "--data", corpus_file(tmp_path), "--out", str(out), "--set", "schedule.global_batch=4",
         "--set", "schedule.micro_batch=4", "--set", "log.progress=false", "--set", "data.eval_samples=8"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_single_process_mode_refuses_zero_2() -> None:
    with pytest.raises(UserError, match="dp_mode=single-process does not combine with parallel.zero=2"):
        config_from_dict({"parallel": {"dp_mode": "single-process", "zero": 2}}).validate()
