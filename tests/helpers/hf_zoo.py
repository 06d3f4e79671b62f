"""Tiny configs of the Hugging Face families the family-matrix tests name (no downloads, seeded weights).

Every family: hidden 64, 2 decoder layers, 4 query heads of 16, 2 kv heads where the family has
grouped kv heads, vocab 256, 64 positions, no dropout, pad/bos/eos id 0 (inside the vocabulary);
MoE families: 4 experts, 2 per token, 32-wide (the sweep's families too: `_TINY_MOE`). Families with sliding-window or soft-capped attention keep
them as their config defines (the window is wider than the tests' 32 tokens unless a test narrows it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ndtrain.models.causal_lm import CausalLM

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma", "gemma2", "gemma3_text", "gpt_neox",
            "gpt2", "mixtral", "qwen2_moe", "qwen3_moe")
# Beyond the named 14: every other causal-LM family of transformers 5.24 whose config declares both
# base_model_tp_plan and base_model_pp_plan and that builds and runs from the generic tiny config
# below (found by enumerating transformers' causal-LM mapping; families needing other sizes are left out).
SWEEP = ("afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "beam", "cohere", "cohere2",
         "cohere2_moe", "cwm", "deepseek_v4", "doge", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4",
         "exaone_moe", "flex_olmo", "flint", "gemma4_text", "gemma4_unified_text", "glm", "glm4", "glm4_moe",
         "gpt_oss", "granite", "granite_swa", "helium", "hrm_text", "hy_v3", "hy_v4", "hyperclovax",
         "inkling_text", "internlm3", "iquestcoder", "jais2", "kolibri1", "laguna", "lara_mini", "mellum",
         "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "olmo",
         "olmo3", "olmo_hybrid", "phi", "phi4_multimodal", "sarvam_moe", "seed_oss", "smollm3", "solar_open",
         "starcoder2", "vaultgemma")
VOCAB = 256
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=0, eos_token_id=0)
_SPECIFIC: dict[str, dict[str, Any]] = {
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "gpt_neox": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                     pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "gemma": dict(_COMMON, head_dim=16),
    "gemma2": dict(_COMMON, head_dim=16, sliding_window=64),
    "gemma3_text": dict(_COMMON, head_dim=16, sliding_window=64),
    "qwen3": dict(_COMMON, head_dim=16),
    "mixtral": dict(_COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, decoder_sparse_step=1),
    "qwen3_moe": dict(_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1),
}


# A family with no specific entry keeps its config's defaults beyond _COMMON, and for a mixture of
# experts those are the full model's (up to 384 experts of width 3072, 300 M+ parameters at hidden 64):
# each of these keys its config has is set to the tiny value. One MoE layer at least (two layers, the
# first dense where the family asks for dense layers first); a single expert group.
_TINY_MOE: dict[str, Any] = {
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "vocab_size_per_layer_input": VOCAB,  # Gemma4's per-layer embeddings (262,144 rows by default)
}
# Phi-4-multimodal's image and audio towers (870 M parameters at their defaults) take no part in text
# training but would hold float64 weights in every process: the smallest towers its config accepts.
_TINY_TOWERS: dict[str, dict[str, Any]] = {
    "phi4_multimodal": dict(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, crop_size=28, patch_size=14),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                          ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32)),
}
_FULL_SIZE_KEPT = ("doge",)  # its 'experts' are a product-key memory of n² keys: its own sizes hold together


def zoo_config(family: str, layers: int = 2, **changes: Any) -> Any:
    """The family's tiny config with `layers` decoder layers (and any other `changes`); a family with no
    specific entry gets the common sizes, with 16-wide heads where its config takes a head_dim, and tiny
    mixture-of-experts sizes (`_TINY_MOE`) where its config has those keys."""
    kwargs = dict(_SPECIFIC.get(family, _COMMON))
    kwargs["n_layer" if family == "gpt2" else "num_hidden_layers"] = layers
    if family not in _SPECIFIC and family not in _FULL_SIZE_KEPT:
        defaults = transformers.AutoConfig.for_model(family)
        kwargs.update({key: value for key, value in _TINY_MOE.items() if hasattr(defaults, key)})
        kwargs.update(_TINY_TOWERS.get(family, {}))
    try:
        config = transformers.AutoConfig.for_model(family, **{**kwargs, "head_dim": 16, **changes}) \
            if family not in _SPECIFIC else transformers.AutoConfig.for_model(family, **{**kwargs, **changes})
    except (AttributeError, TypeError, ValueError):
        config = transformers.AutoConfig.for_model(family, **{**kwargs, **changes})
    if getattr(config, "layer_types", None) is not None and len(config.layer_types) != layers:
        config.layer_types = config.layer_types[:layers]
    return config


def zoo_model(family: str, layers: int = 2, dtype: torch.dtype = torch.float64, **changes: Any) -> CausalLM:
    """The same weights in every process: seeded, the caller's RNG untouched; behind the `CausalLM` adapter."""
    config = zoo_config(family, layers, **changes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(config)
    if dtype == torch.float64 and getattr(config, "_experts_implementation", None) not in (None, "eager"):
        hf.set_experts_implementation("eager")  # grouped_mm takes no float64
    if dtype == torch.float64 and family in WIDE_ROUTERS:
        router_class, forward = WIDE_ROUTERS[family]
        for module in hf.modules():
            if type(module).__name__ == router_class:
                module.forward = forward.__get__(module)
    return CausalLM(hf).to(dtype)


def _kolibri1_router_in_model_dtype(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' Kolibri1TopKRouter.forward, its product in the model's dtype instead of float32."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    router_indices = torch.topk(router_logits + self.e_score_correction_bias, self.top_k, dim=-1)[1]
    router_scores = router_logits.gather(1, router_indices).sigmoid()
    if self.norm_topk_prob:
        router_scores = router_scores / router_scores.sum(dim=-1, keepdim=True)
    return router_logits, router_scores, router_indices


# Routers that multiply in float32 whatever the model's dtype, replaced (float64 models only) by the
# same forward in the model's dtype: family -> (transformers' router class name, forward). Under
# sequence parallelism each rank's router multiplies its own token shard, and a float32 product of
# N/2 rows rounds differently from one of N rows (≈1e-7), which AdamW's first steps amplify:
# Kolibri1 under tp2+sp ended 2e-4 to 3e-3 away from one process, under tp2 without sp (N rows on
# every rank) within 1e-8; with its router in float64, tp2+sp is within 3.5e-14 (2026-11-28). The
# float64 parity tests compare ndtrain's arithmetic, not float32's rounding of a shape.
WIDE_ROUTERS: dict[str, tuple[str, Any]] = {"kolibri1": ("Kolibri1TopKRouter", _kolibri1_router_in_model_dtype)}
