"""`ndtrain generate`: text from a trained run, by temperature and top-k sampling (temperature 0: greedy).

Two paths, one process:
- With transformers installed (the usual case): the Hugging Face model's own `generate`, which keeps a
  KV cache (each new token costs one forward of one position: O(n · context) attention work for n
  tokens). An `hf:PATH` run generates with its own transformers model; a built-in Llama run is
  converted in memory to the `LlamaForCausalLM` that `ndtrain export --format hf` writes
  (models/llama_hf.py: the same weights, the same logits).
- Without transformers (a built-in Llama run only): `sample`, which re-runs the whole window for every
  token (O(n · seq_len²)), fine for the small models trained here.
Both see at most the run's `seq_len` tokens, as in training: `sample` the last seq_len tokens at each
step; `generate` fills the window from its cache, then restarts from the last seq_len/2 tokens (one
forward of them), so positions never pass the trained length. Within the first window both give the
same greedy tokens.

Generation stops after `max_new_tokens` or at the end-of-sequence token (the tokenizer's EOS, byte 0 for
the byte tokenizer, else the HF model's config), which is not printed. `chat=True` renders the prompt
with the run tokenizer's chat template as one user message (`add_generation_prompt`) and returns only
the reply; a tokenizer without a chat template (the byte tokenizer, a tokenizer.json, a transformers
tokenizer without one) gets the ChatML rendering its chat records were trained on (data/sft.py:
`chatml_prompt_ids`), and the reply ends at its first `<|im_end|>`.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Collection

import torch
from torch import nn

from ndtrain.checkpoint.run_model import load_run
from ndtrain.config.presets import TASK_PRESETS
from ndtrain.data.sft import CHATML_END, chatml_prompt_ids
from ndtrain.data.tokenizer import HFTokenizer, load_tokenizer
from ndtrain.errors import UserError
from ndtrain.models.hf import is_hf_model


@torch.no_grad()
def sample(
    model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, seq_len: int,
    temperature: float, top_k: int, generator: torch.Generator, eos: Collection[int] = (),
) -> torch.Tensor:
    """Extend the 1-D token tensor `prompt` by up to `max_new_tokens` sampled tokens, the whole window
    re-run for each; stop after a token in `eos` (kept)."""
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
        if int(next_token) in eos:
            break
    return tokens


@torch.no_grad()
def cached_generate(
    hf_model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, seq_len: int,
    temperature: float, top_k: int, seed: int, eos: Collection[int] = (),
) -> torch.Tensor:
    """`sample` by the transformers model's own `generate` (KV cache), the context kept within `seq_len`
    tokens; sampling draws from the global RNG seeded with `seed` inside a forked RNG state."""
    from transformers import GenerationConfig

    greedy = temperature == 0
    tokens = prompt.long()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        while max_new_tokens > 0:
            context = tokens if len(tokens) < seq_len else tokens[-max(seq_len // 2, 1):]
            steps = min(max_new_tokens, seq_len - len(context))
            # a fresh config: none of the model folder's own sampling defaults (top_p...) apply
            hf_model.generation_config = GenerationConfig(
                max_new_tokens=steps, do_sample=not greedy, temperature=None if greedy else temperature,
                top_k=None if greedy or top_k == 0 else top_k, eos_token_id=list(eos) or None,
                pad_token_id=next(iter(eos), 0), use_cache=True)
            out = hf_model.generate(context.unsqueeze(0), attention_mask=torch.ones_like(context).unsqueeze(0))
            new = out[0, len(context):]
            tokens = torch.cat([tokens, new])
            max_new_tokens -= len(new)
            if len(new) == 0 or int(new[-1]) in eos:
                break
    return tokens


def eos_ids(tokenizer: Any, hf_model: nn.Module | None) -> set[int]:
    """The end-of-sequence ids: the tokenizer's, else the HF model's generation config or config (byte 0 for bytes)."""
    ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None and hf_model is not None:
        ids = getattr(hf_model.generation_config, "eos_token_id", None) or getattr(hf_model.config, "eos_token_id", None)
    if ids is None:
        return set()
    return {int(i) for i in ids} if isinstance(ids, (list, tuple)) else {int(ids)}


def hf_model_of(model: nn.Module, cfg: Any) -> nn.Module | None:
    """The transformers model to generate with: the run's own (`hf:PATH`), the built-in Llama converted
    in memory, or None when transformers is not installed (a built-in run then uses `sample`)."""
    if is_hf_model(cfg.model.preset):
        return model.hf
    if importlib.util.find_spec("transformers") is None:
        return None
    from ndtrain.models.llama_hf import builtin_to_hf

    return builtin_to_hf(model, cfg.model)


def generate_text(
    run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int, chat: bool = False,
) -> str:
    """The prompt and its continuation (with `chat`: the reply alone), EOS not included."""
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
    template = chat and isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template is not None
    if template:
        prompt = tokenizer.render_chat([{"role": "user", "content": prompt}])
    prompt_ids = chatml_prompt_ids(tokenizer, prompt) if chat and not template else tokenizer.encode(prompt or "\n")
    if len(prompt_ids) == 0:
        raise UserError(f"the prompt {prompt!r} encodes to no tokens with data.tokenizer={cfg.data.tokenizer!r}: give "
                        "a --prompt of words the tokenizer knows")
    hf_model = hf_model_of(model, cfg)
    eos = eos_ids(tokenizer, hf_model)
    seq_len = cfg.model.seq_len
    if hf_model is not None:
        out = cached_generate(hf_model, prompt_ids, max_new_tokens, seq_len, temperature, top_k, seed, eos)
    else:
        out = sample(model, prompt_ids, max_new_tokens, seq_len, temperature, top_k,
                     torch.Generator().manual_seed(seed), eos)
    if len(out) > len(prompt_ids) and int(out[-1]) in eos:
        out = out[:-1]
    if not chat:
        return tokenizer.decode(out)
    reply = tokenizer.decode(out[len(prompt_ids):])
    return reply if template else reply.split(CHATML_END)[0]  # ChatML: the reply ends at its end marker
