"""The built-in Llama as Hugging Face's `LlamaForCausalLM`: parameter names both ways and the config.

The two are the same architecture (RMSNorm, RoPE on the two halves of each head as HF's
`rotate_half`, SwiGLU, grouped-query attention), so converting is a renaming (`LLAMA_TO_HF`) with no
permutation of q/k rows. `ndtrain export --format hf` writes a Llama run through `builtin_to_hf`;
`model.init_from` reads HF Llama weights back through `hf_names_to_llama`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.errors import UserError
from ndtrain.models.hf import require_transformers
from ndtrain.parallel.model.lora import merged_state_dict

# built-in Llama name (regex) → LlamaForCausalLM name
LLAMA_TO_HF: list[tuple[str, str]] = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.wq\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.wk\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.wv\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]


def _rename(name: str, table: list[tuple[str, str]]) -> str | None:
    for pattern, replacement in table:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def llama_names_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A built-in Llama state dict under LlamaForCausalLM's names."""
    out = {}
    for name, tensor in state.items():
        hf_name = _rename(name, LLAMA_TO_HF)
        if hf_name is None:
            raise UserError(f"cannot export parameter {name!r} of the built-in model to LlamaForCausalLM")
        out[hf_name] = tensor
    return out


def hf_names_to_llama(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `llama_names_to_hf`; names it does not know are kept (and refused by the caller)."""
    inverse = [(re.escape(hf).replace(r"\\1", r"(\d+)"), ours.replace(r"(\d+)", r"\1").replace("\\.", "."))
               for ours, hf in LLAMA_TO_HF]
    return {(_rename(name, inverse) or name): tensor for name, tensor in state.items()}


def llama_hf_config(cfg: ModelConfig) -> Any:
    """The `LlamaConfig` of a built-in Llama with these sizes."""
    transformers = require_transformers()
    return transformers.LlamaConfig(
        hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.dim // cfg.n_heads,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )


def builtin_to_hf(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """A `LlamaForCausalLM` holding the built-in model's weights (fp32; LoRA adapters merged)."""
    transformers = require_transformers()
    hf_model = transformers.LlamaForCausalLM(llama_hf_config(cfg)).to(torch.float32)
    hf_model.load_state_dict(llama_names_to_hf(merged_state_dict(model)), strict=True)
    return hf_model.eval()
