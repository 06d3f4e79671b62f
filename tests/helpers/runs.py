"""Runs of the real program for tests: corpora, tiny run configs, training in-process or through
the CLI in a subprocess, and the one-line user error such a run must end with."""

from __future__ import annotations

import inspect
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from ndtrain.config import TrainConfig
from ndtrain.run.config_checks import resolve_config
from ndtrain.dist.mesh import init
from ndtrain.checkpoint.run_model import build_run_model
from ndtrain.trainer import Trainer
from tests.helpers.runner import init_method

# CLI arguments of a tiny run: 8 sequences per step in micro-batches of 2, no progress bar, no eval
TINY_ARGS = ["--model", "tiny", "--set", "schedule.global_batch=8", "--set", "schedule.micro_batch=2",
             "--set", "log.progress=false", "--set", "data.eval_samples=8", "--set", "log.log_every=1",
             "--set", "log.eval_every=0"]
# the same run with its default evaluation, 4 steps
TINY_4_STEPS = ["--model", "tiny", "--steps", "4", "--set", "schedule.global_batch=8", "--set", "schedule.micro_batch=2",
                "--set", "log.progress=false", "--set", "data.eval_samples=8", "--set", "log.log_every=1"]
WORDS = "the a fox dog cat runs jumps over under lazy quick brown red green sees eats".split()


# ------------------------------------------------------------------------------------ corpora
def corpus_file(tmp_path: Path) -> str:
    """About 60 KB of real text: a standard library module's source."""
    path = tmp_path / "corpus.txt"
    path.write_text(inspect.getsource(textwrap) * 3)
    return str(path)


def texts(count: int = 80, seed: int = 0) -> list[str]:
    """`count` seeded sentences of 5 to 30 words from a 16-word vocabulary."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) + "." for _ in range(count)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(docs)))
    return path


def train_tokenizer(path: Path, docs: list[str], kind: str = "bpe") -> Path:
    """A tokenizer trained here on `docs` and saved as tokenizer.json (no download); its special tokens are
    [UNK] and "</s>", the end-of-sequence token `with_eos` names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    else:
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"], show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tok.save(str(path))
    return path


def with_eos(file: Path) -> Path:
    """A tokenizer.json of `train_tokenizer` as a transformers tokenizer folder naming "</s>" its
    end-of-sequence token (a tokenizer.json names none; token files end every document with it)."""
    from transformers import PreTrainedTokenizerFast

    folder = file.parent / f"{file.stem}-eos"
    PreTrainedTokenizerFast(tokenizer_file=str(file), eos_token="</s>").save_pretrained(str(folder))
    return folder


# ------------------------------------------------------------------------------------ in-process runs
def tiny_config(data: str, out: str, **overrides: object) -> TrainConfig:
    base = {
        "model.preset": "tiny", "data.path": data, "log.out": out, "log.progress": False,
        "schedule.steps": 6, "schedule.global_batch": 8, "schedule.micro_batch": 4,
        "schedule.warmup_steps": 2, "data.eval_samples": 16, "log.eval_every": 0, "log.log_every": 1,
    }
    base.update(overrides)
    if "schedule.warmup_steps" not in overrides:  # a warmup must be below the run's steps (1 for a 2-step run)
        base["schedule.warmup_steps"] = min(2, int(base["schedule.steps"]) - 1)  # type: ignore[call-overload]
    return resolve_config(None, base)


def train(cfg: TrainConfig, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Run the trainer on `cfg` (under the test runner's rendezvous when dp > 1); its model's state.

    `dtype=torch.float64`: the config's model in float64 (parity runs: in fp32, AdamW turns the
    last-bit rounding of a differently ordered gradient sum into ~1e-5 parameter differences, more
    or less depending on the CPU's kernels; in float64 they are ~1e-14)."""
    ctx = init(cfg.parallel, init_method=init_method()) if cfg.parallel.dp != 1 else init(cfg.parallel)
    model_fn = None if dtype is None else lambda: build_run_model(cfg.model, cfg.seed).to(dtype)
    trainer = Trainer(cfg, ctx, model_fn=model_fn)
    trainer.run()
    return {k: v.detach().clone() for k, v in trainer.engine.model.state_dict().items()}


# ------------------------------------------------------------------------------------ the CLI
def ndtrain(*args: str, launcher: tuple[str, ...] = ("-m", "ndtrain")) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *launcher, *args], capture_output=True, text=True, timeout=240)


def train_cli(out: Path, data: str, steps: int, *more: str) -> subprocess.CompletedProcess:
    """`ndtrain train` of the tiny model on 2 processes, a checkpoint every 2 steps."""
    return ndtrain("train", "--nproc", "2", "--data", data, "--out", str(out), "--steps", str(steps),
                   "--save-every", "2", *TINY_ARGS, *more)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The run's single `ndtrain: error:` line, asserting exit status 2 and no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ndtrain: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]
