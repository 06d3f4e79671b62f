"""CausalLM adapter: logits of the wrapped HF model, and its loss computed once on unshifted targets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from ndtrain.models.causal_lm import CausalLM  # noqa: E402


def tiny_llama() -> CausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return CausalLM(transformers.LlamaForCausalLM(cfg))


def test_logits_are_the_hf_models() -> None:
    model = tiny_llama().eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    torch.testing.assert_close(logits, model.hf(input_ids=tokens, use_cache=False).logits, rtol=0, atol=0)


def test_loss_is_cross_entropy_of_logits_vs_targets_not_shifted_again() -> None:
    model = tiny_llama().eval()
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (2, 16), generator=gen)
    targets = torch.randint(0, 256, (2, 16), generator=gen)
    logits = model.hf(input_ids=tokens, use_cache=False).logits
    loss = model(tokens, targets)
    assert loss.ndim == 0 and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    # HF's own labels= shifts once more: a different number, which the adapter must not compute.
    shifted = model.hf(input_ids=tokens, labels=targets, use_cache=False).loss
    assert not torch.allclose(loss, shifted)


def test_position_ids_per_token_are_passed_through() -> None:
    model = tiny_llama().eval()
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    offset = torch.arange(8, 16)
    expected = model.hf(input_ids=tokens, position_ids=offset[None], use_cache=False).logits
    torch.testing.assert_close(model(tokens, position_ids=offset), expected, rtol=0, atol=0)
    assert not torch.allclose(model(tokens), expected)
