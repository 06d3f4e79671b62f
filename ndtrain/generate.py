"""Sampling text from a trained run: temperature and top-k sampling, one process, no KV cache.

Each new token re-runs the model on the last seq_len tokens: O(n · seq_len²) work for n tokens,
which is fine for the small models trained here.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from ndtrain.checkpoint.run_model import load_run
from ndtrain.config.presets import TASK_PRESETS
from ndtrain.data.tokenizer import load_tokenizer
from ndtrain.errors import UserError


@torch.no_grad()
def sample(
    model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, seq_len: int,
    temperature: float, top_k: int, generator: torch.Generator,
) -> torch.Tensor:
    """Extend the 1-D token tensor `prompt` by `max_new_tokens` sampled tokens."""
    tokens = prompt.long()
    for _ in range(max_new_tokens):
        logits = model(tokens[-seq_len:].unsqueeze(0))[0, -1].float()
        if temperature == 0:
            next_token = logits.argmax()
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                cutoff = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            next_token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[0]
        tokens = torch.cat([tokens, next_token.view(1)])
    return tokens


def generate_text(
    run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int
) -> str:
    if not 0 <= temperature < math.inf:
        raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = no cutoff), got {top_k}")
    if max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if not 0 <= seed < 2**63:
        raise UserError(f"--seed must be in [0, 2**63), got {seed}")
    cfg, model, _ = load_run(run_dir)
    if cfg.model.preset in TASK_PRESETS:
        raise UserError(f"{str(run_dir)!r} trained --model {cfg.model.preset}, which does not generate text: "
                        "give the run directory of a language model")
    tokenizer = load_tokenizer(cfg.data.tokenizer)  # the run's, as its config.toml names it
    prompt_ids = tokenizer.encode(prompt or "\n")
    if len(prompt_ids) == 0:
        raise UserError(f"the prompt {prompt!r} encodes to no tokens with data.tokenizer={cfg.data.tokenizer!r}: give "
                        "a --prompt of words the tokenizer knows")
    generator = torch.Generator().manual_seed(seed)
    out = sample(model, prompt_ids, max_new_tokens, cfg.model.seq_len, temperature, top_k, generator)
    return tokenizer.decode(out)
