"""Tiny configs of the Hugging Face families the family-matrix tests name (no downloads, seeded weights).

Every family: hidden 64, 2 decoder layers, 4 query heads of 16, 2 kv heads where the family has
grouped kv heads, vocab 256, 64 positions, no dropout (a swept family's every dropout key 0), pad/bos/eos
id 0 (inside the vocabulary); MoE families: 4 experts, 2 per token, 32 wide (swept ones: `_TINY_MOE`).
Families with sliding-window or soft-capped attention keep them as their config defines (the window is
wider than the tests' 32 tokens unless a test narrows it).
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
# training but would hold float64 weights in every process: the smallest towers its config accepts,
# frozen (`zoo_model`), as a text fine-tune leaves them (trainable, ndtrain refuses parameters that
# receive no gradient unless parallel.allow_unused_params is set).
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
        kwargs.update({key: 0.0 for key, value in defaults.to_dict().items()  # Seed-OSS: 0.1 by default
                       if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0})
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
    if family in _TINY_TOWERS:
        hf.model.embed_tokens_extend.requires_grad_(False)
    if dtype == torch.float64 and family in FLOAT32_ISLANDS:
        keep_float64(hf)
    return CausalLM(hf).to(dtype)


# Families whose modules compute parts in float32 whatever the model's dtype, and whose float64
# parity cells differ at the 1e-5 bound because of it: each rank of a split layout runs those float32
# products on its own shard (N/2 tokens, its heads, its sequence chunk), which float32 rounds
# differently from the whole (≈1e-7), and AdamW's first steps amplify that. Kolibri1's router
# multiplies in float32 (tp2+sp: 2e-4..3e-3 away, within 1e-8 without sp; with the product in float64,
# 3.5e-14); Gemma4 casts q, k and v to float32 (tp2+sp and cp2: 4.5e-4 and 3.8e-4 on the per-layer
# embeddings; Gemma4-unified cp2 1.0e-5). Their float64 test models keep float64 throughout
# (`keep_float64`): the parity tests compare ndtrain's arithmetic, not float32's rounding of a shape.
FLOAT32_ISLANDS = ("kolibri1", "gemma4_text", "gemma4_unified_text")


class _KeepFloat64(torch.overrides.TorchFunctionMode):
    """While active: a cast of a float64 tensor to float32 (`.float()`, a float32 dtype given to `.to`,
    `.type`, softmax or a matmul's out_dtype) keeps float64."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            if func is torch.Tensor.float:
                return args[0]
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def keep_float64(model: torch.nn.Module) -> None:
    """Run every forward of `model`'s modules (a decoder layer called alone by a pipeline stage too)
    under `_KeepFloat64`; the backward follows the forward's dtypes. The closing hook runs when a forward
    raises too (ndtrain's meta-device probes do): the mode must not outlive the call in the process."""
    mode, depth = _KeepFloat64(), [0]

    def enter(*_: Any) -> None:
        if depth[0] == 0:
            mode.__enter__()
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            mode.__exit__(None, None, None)

    for module in model.modules():
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
