"""Persistent buffers (BatchNorm's running statistics) are part of a checkpoint (checkpoint/buffers.py).

A BatchNorm net trained 2 steps by one `Engine`, saved, loaded into a fresh engine: running mean,
variance and batch count equal the trained ones bit for bit, and one more step of both gives the
same parameters and buffers (a resume is bit-identical); `load_model_weights` (export, generate,
`--init-from`) restores them too; a checkpoint written before buffers were saved leaves them as built.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from ndtrain.checkpoint.store import load_model_weights
from ndtrain.config import ParallelConfig
from ndtrain.dist.mesh import init
from ndtrain.engine import Engine


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.body(x), y)


def _batch(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(step)
    return [(torch.randn(16, 6, generator=generator) * 3 + 1, torch.randint(0, 3, (16,), generator=generator))]


def _engine() -> Engine:
    return Engine(_BatchNormNet, lambda groups: torch.optim.AdamW(groups, lr=1e-2), init(ParallelConfig()), ParallelConfig())


def _buffers(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: module._buffers[key].clone() for name, (module, key) in engine.buffer_sites.items()}  # type: ignore[union-attr]


def test_running_statistics_are_saved_loaded_and_resume_bit_identically(tmp_path: Path) -> None:
    trained = _engine()
    for step in range(2):
        trained.train_step(_batch(step))
    built = _buffers(_engine())
    saved = _buffers(trained)
    assert set(saved) == {"body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"}
    assert not torch.equal(saved["body.1.running_mean"], built["body.1.running_mean"])
    path = trained.save(tmp_path / "ckpt")
    resumed = _engine()
    resumed.load(tmp_path / "ckpt")
    assert all(torch.equal(_buffers(resumed)[name], value) for name, value in saved.items())
    trained.train_step(_batch(2))
    resumed.train_step(_batch(2))
    for name, value in _buffers(trained).items():
        assert torch.equal(_buffers(resumed)[name], value), name
    for name, value in trained.full_state_dict().items():
        assert torch.equal(resumed.full_state_dict()[name], value), name
    # export / generate / --init-from read weights into a bare model: the statistics come too
    bare = _BatchNormNet()
    load_model_weights(path, bare)
    assert torch.equal(bare.body[1].running_var, saved["body.1.running_var"])
    # a checkpoint without buffers/ (written before they were saved) loads, statistics as built
    shutil.rmtree(path / "buffers")
    older = _BatchNormNet()
    load_model_weights(path, older)
    assert torch.equal(older.body[1].running_mean, built["body.1.running_mean"])
