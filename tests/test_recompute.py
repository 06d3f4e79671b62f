"""Activation recomputation: same loss and gradients in every mode, fewer saved bytes, as derived.

Single process (the composition with ring attention at cp=2 is in test_context_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from ndtrain.config import ParallelConfig, config_from_dict
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.models.llama_parallel import block_saved_bytes
from ndtrain.parallel.model.context import RingAttend, apply_context_parallel
from ndtrain.parallel.model.recompute import MODES, SavedActivations, SelectiveRecompute, apply_recompute

SEED = 3
TOL = 1e-6


def tiny(**overrides):
    return config_from_dict({"model": {"preset": "tiny", **overrides}}).model


def loss_and_grads(mode: str, cfg) -> tuple[torch.Tensor, list[torch.Tensor]]:
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(SEED))
    model = apply_recompute(build_model(cfg, SEED), mode)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_same_loss_and_gradients(mode: str) -> None:
    cfg = tiny()
    ref_loss, ref_grads = loss_and_grads("none", cfg)
    loss, grads = loss_and_grads(mode, cfg)
    assert ((loss - ref_loss).abs() / ref_loss.abs()).item() <= TOL
    for g, r in zip(grads, ref_grads, strict=True):
        assert ((g - r).abs().max() / r.abs().max()).item() <= TOL


@pytest.mark.parametrize("overrides", [{}, {"n_heads": 6, "n_kv_heads": 2, "dim": 48, "ffn_dim": 80, "seq_len": 24}])
def test_saved_bytes_per_block_match_formula(overrides: dict) -> None:
    """One block on B·T tokens: bytes saved for backward = `block_saved_bytes` + the RoPE tables (e·T·h)."""
    cfg = tiny(**overrides)
    batch, seq, head_dim = 2, cfg.seq_len, cfg.dim // cfg.n_heads
    measured = {}
    for mode in MODES:
        model = apply_recompute(build_model(cfg, SEED), mode)
        x = torch.randn(batch, seq, cfg.dim, requires_grad=True)
        cos, sin = model.rotary(torch.arange(seq))
        with SavedActivations(model) as saved:
            model.layers[0](x, cos, sin)
        measured[mode] = saved.bytes
        assert saved.bytes == block_saved_bytes(cfg, batch * seq, mode) + 4 * seq * head_dim, mode
    assert measured["full"] < measured["selective"] < measured["none"]


def test_saved_bytes_whole_model_ordered() -> None:
    cfg = tiny()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(SEED))
    measured = {}
    for mode in MODES:
        model = apply_recompute(build_model(cfg, SEED), mode)
        with SavedActivations(model) as saved:
            model(tokens[:, :-1], tokens[:, 1:])
        measured[mode] = saved.bytes
    per_layer = {m: block_saved_bytes(cfg, 2 * cfg.seq_len, m) for m in MODES}
    # Everything outside the blocks is the same in every mode, so the differences are the formula's.
    for mode in ("selective", "full"):
        assert measured["none"] - measured[mode] == cfg.n_layers * (per_layer["none"] - per_layer[mode])


def test_core_runs_again_in_backward() -> None:
    """Selective recompute calls the attention core twice per block (forward, then in backward)."""
    cfg = tiny()
    model = apply_recompute(build_model(cfg, SEED), "selective")
    calls = []
    for layer in model.layers:
        inner = layer.attention.attend.inner
        layer.attention.attend.inner = lambda q, k, v, documents=None, inner=inner: calls.append(1) or inner(q, k, v, documents)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(SEED))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    assert len(calls) == cfg.n_layers
    loss.backward()
    assert len(calls) == 2 * cfg.n_layers


@pytest.mark.parametrize("cp_first", [True, False])
def test_selective_composes_with_context_parallel(cp_first: bool) -> None:
    """Either order leaves ring attention inside the recompute wrapper."""
    ctx = init(ParallelConfig())
    model = build_model(tiny(), SEED)
    if cp_first:
        apply_recompute(apply_context_parallel(model, ctx), "selective")
    else:
        apply_context_parallel(apply_recompute(model, "selective"), ctx)
    for layer in model.layers:
        assert isinstance(layer.attention.attend, SelectiveRecompute)
        assert isinstance(layer.attention.attend.inner, RingAttend)


def test_unknown_mode() -> None:
    with pytest.raises(UserError, match="recompute mode 'some'"):
        apply_recompute(build_model(tiny(), SEED), "some")
