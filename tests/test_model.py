"""The Llama model: deterministic init, causality, GQA, RoPE, tying, parameter counts."""

import math

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import MODEL_PRESETS, ModelConfig
from ndtrain.errors import UserError
from ndtrain.models import Llama, build_model
from ndtrain.parallel.counting import count_parameters
from ndtrain.models.llama import apply_rotary, rotary_tables


def preset(name: str, **overrides: object) -> ModelConfig:
    return ModelConfig(**{"preset": name, **MODEL_PRESETS[name], **overrides})


def expected_parameters(cfg: ModelConfig) -> int:
    """V·d embedding + L·(2d² + 2·d·K·h + 3·d·f + 2d) + d final norm + V·d head unless tied."""
    d, h = cfg.dim, cfg.dim // cfg.n_heads
    per_layer = 2 * d * d + 2 * d * cfg.n_kv_heads * h + 3 * d * cfg.ffn_dim + 2 * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + cfg.n_layers * per_layer + d + head


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_preset_parameter_counts_match_formula(name: str) -> None:
    cfg = preset(name)
    assert count_parameters(Llama(cfg)) == expected_parameters(cfg)


def test_preset_sizes_are_as_advertised() -> None:
    assert 10e6 <= expected_parameters(preset("bench")) <= 20e6
    assert 2.5e6 <= expected_parameters(preset("small")) <= 3.5e6


def test_same_seed_same_weights_and_caller_rng_untouched() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_model(preset("tiny"), seed=7).state_dict()
    b = build_model(preset("tiny"), seed=7).state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    c = build_model(preset("tiny"), seed=8).state_dict()
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    assert not torch.equal(a["tok_embeddings.weight"], c["tok_embeddings.weight"])


def test_state_dict_holds_only_weights() -> None:
    model = build_model(preset("tiny"), seed=0)
    assert list(model.buffers()) == []
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()}
    assert {"tok_embeddings.weight", "norm.weight", "output.weight", "layers.1.feed_forward.w2.weight"} <= set(
        model.state_dict()
    )


def test_init_statistics() -> None:
    cfg = preset("small")
    model = build_model(cfg, seed=0)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    assert model.layers[0].attention.wq.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert model.layers[0].attention.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.layers[3].feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert torch.equal(model.layers[0].ffn_norm.weight, torch.ones(cfg.dim))


def test_logits_shape_and_loss_is_their_cross_entropy() -> None:
    model = build_model(preset("tiny"), seed=0)
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(tokens, -1, dims=1)
    logits = model(tokens)
    assert logits.shape == (3, 20, 256)
    loss = model(tokens, targets)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)))


def test_initial_loss_is_near_uniform() -> None:
    model = build_model(preset("tiny"), seed=0)
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, torch.roll(tokens, -1, dims=1))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_causal() -> None:
    model = build_model(preset("tiny"), seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_attention_matches_explicit_kv_repetition(n_kv_heads: int) -> None:
    cfg = preset("tiny", n_kv_heads=n_kv_heads)
    model = build_model(cfg, seed=3)
    attention = model.layers[0].attention
    x = torch.randn(2, 10, cfg.dim, generator=torch.Generator().manual_seed(4))
    cos, sin = rotary_tables(torch.arange(10), attention.head_dim, cfg.rope_theta)
    with torch.no_grad():
        out = attention(x, cos, sin)

        def heads(w: torch.Tensor) -> torch.Tensor:
            return (x @ w.T).view(2, 10, -1, attention.head_dim).transpose(1, 2)

        q = apply_rotary(heads(attention.wq.weight), cos, sin)
        k = apply_rotary(heads(attention.wk.weight), cos, sin)
        v = heads(attention.wv.weight)
        group = cfg.n_heads // n_kv_heads  # query head i reads kv head i // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(attention.head_dim)
        scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
        reference = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, cfg.dim) @ attention.wo.weight.T
    assert k.shape[1] == cfg.n_heads
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    model(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)).backward()
    assert attention.wk.weight.grad is not None and attention.wk.weight.grad.abs().sum() > 0


def test_rope_scores_depend_only_on_relative_position() -> None:
    head_dim = 8
    q, k = torch.randn(2, 1, 1, 1, head_dim, generator=torch.Generator().manual_seed(5)).unbind(0)

    def score(m: int, n: int) -> float:
        cos, sin = rotary_tables(torch.tensor([m, n]), head_dim, 10000.0)
        return (apply_rotary(q, cos[:1], sin[:1]) * apply_rotary(k, cos[1:], sin[1:])).sum().item()

    assert score(3, 1) == pytest.approx(score(10, 8), abs=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)
    cos, sin = rotary_tables(torch.tensor([0]), head_dim, 10000.0)
    torch.testing.assert_close(apply_rotary(q, cos, sin), q)  # position 0 is not rotated


def test_tied_embeddings_share_one_tensor_counted_once() -> None:
    tied = build_model(preset("tiny", tie_embeddings=True), seed=0)
    untied = build_model(preset("tiny"), seed=0)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert count_parameters(tied) == count_parameters(untied) - 256 * 32
    assert count_parameters(tied) == expected_parameters(preset("tiny", tie_embeddings=True))
    tokens = torch.randint(0, 256, (1, 8))
    tied(tokens, tokens).backward()
    assert tied.tok_embeddings.weight.grad is not None


def test_bad_shapes_are_user_errors() -> None:
    with pytest.raises(UserError, match="n_kv_heads=3"):
        Llama(preset("tiny", n_kv_heads=3))
    with pytest.raises(UserError, match="dim=30"):
        Llama(preset("tiny", dim=30))
