"""Tiny Hugging Face models (Llama, Qwen2 with a tied head, GPT-2 with a tied head) built from
configs here, seeded, no downloads: folders for `--model hf:DIR` runs, and the float64 models,
batches, optimizer and single-process reference of the HF strategy-parity tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ndtrain.config import TrainConfig
from ndtrain.models.causal_lm import CausalLM
from tests.helpers.models import Batch, token_batch
from tests.helpers.reference import decay_groups, train_reference
from tests.helpers.runner import Spawns
from tests.helpers.runs import tiny_config

transformers = pytest.importorskip("transformers")

# the parity runs: 5 steps of 4 sequences of 32 tokens, float64 (see tests/test_hf_strategies.py)
STEPS = 5
GLOBAL_BATCH = 4
SEQ = 32
VOCAB = 256
LR = 1e-3
TOL = 1e-5
DTYPE = torch.float64


# ------------------------------------------------------------------------------------ folders for the CLI
def hf_dir_config(family: str) -> Any:
    """A tiny config of the family: hidden 32, 2 layers, 4 heads (2 kv heads), vocab 256, 64 positions,
    no dropout (GPT-2's default 0.1 would make layouts draw different masks)."""
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    return (transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config)(**sizes)


def hf_dir(root: Path, family: str, weights: torch.nn.Module | None = None) -> Path:
    """A folder with the family's config.json (and, given a model, its weights), as save_pretrained writes it."""
    path = root / f"hf-{family}{'-weights' if weights is not None else ''}"
    if weights is not None:
        weights.save_pretrained(str(path))
    else:
        hf_dir_config(family).save_pretrained(str(path))
    return path


def hf_run_config(data: str, out: str, model_dir: Path, **overrides: object) -> TrainConfig:
    return tiny_config(data, out, **{"model.preset": f"hf:{model_dir}", "model.seq_len": 32,
                                     "schedule.steps": 5, **overrides})


# ------------------------------------------------------------------------------------ strategy parity
def hf_config(family: str) -> Any:
    """Hidden 64, 2 layers, 4 heads (2 kv heads), vocab 256; Qwen2's head tied to its embedding."""
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    return cls(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=family == "qwen2",
    )


def make_model(family: str, layers: int = 2) -> CausalLM:
    """The same weights in every process: seeded, the caller's RNG untouched; `layers` decoder layers."""
    config = hf_config(family)
    setattr(config, "n_layer" if family == "gpt2" else "num_hidden_layers", layers)
    if family == "qwen2":
        config.layer_types = ["full_attention"] * layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(config)
    return CausalLM(hf).to(DTYPE)


def batch(step: int) -> Batch:
    return token_batch(step, GLOBAL_BATCH, SEQ, VOCAB)


def adamw(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=0.1)


@functools.cache
def reference(family: str, pieces: int, layers: int = 2) -> dict[str, torch.Tensor]:
    """Single process, the whole global batch, loss the mean of `pieces` equal chunks: the distinct parameters."""
    model = make_model(family, layers)
    return train_reference(model, adamw(decay_groups(model)), map(batch, range(STEPS)), pieces=pieces).params


@dataclass(frozen=True)
class StrategyMatrix:
    """An HF strategy-parity matrix: (family, strategy) cases, a fast and a slow set; each strategy runs on
    a layout (its first field in `strategies`), whose spawn of `processes[layout]` workers runs all its cases."""

    strategies: dict[str, tuple]
    fast: dict[str, tuple[str, ...]]
    slow: dict[str, tuple[str, ...]]
    processes: dict[str, int]

    def params(self) -> list[Any]:
        """One pytest case per (family, strategy, slow), the slow ones marked slow."""
        sets = ((self.fast, False), (self.slow, True))
        return [pytest.param(f, s, slow, id=f"{f}-{s}", marks=[pytest.mark.slow] if slow else [])
                for table, slow in sets for f, names in table.items() for s in names]

    def runs(self, spawns: Spawns, layout: str, slow: bool) -> list[dict]:
        """The results of the spawn running `layout`'s cases of the fast or slow set (started at first need)."""
        table = self.slow if slow else self.fast
        cases = [(f, s) for f, names in table.items() for s in names if self.strategies[s][0] == layout]
        return spawns.get((layout, slow), self.processes[layout], layout, cases)
