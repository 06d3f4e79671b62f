"""`model.attention` (auto | sdpa | eager): the attention implementation an hf: model is built with.

- `auto` resolves per class: SDPA where `_supports_sdpa` (Llama), else eager (Gemma2, whose soft-capped
  attention SDPA cannot do); an explicit value the class does not support (Gemma2 with sdpa) is one line.
- The resolved value is what the run's config holds (config.toml, `--check`'s output) and what every
  rank builds (the launcher's meta model and the workers' model); the key is refused for other models.
- Errors end the run in one line, exit 2, after at most one attempt and never retried: the launcher
  refuses Gemma2 with sdpa, or with `--cp 2` (soft-capping), before any worker starts (no rank log is
  written); a worker building it anyway (its config unresolved) raises a UserError, which
  ndtrain/failures.py never restarts.
- Gemma2 trains (slow): float64 parity with one process under dp2 × ZeRO-3 with full recompute and
  under pp2 × dp2 with ZeRO-1; `ndtrain train --nproc 2 --zero 3 --recompute full --precision bf16`
  finishes with the implementation recorded in config.toml.
"""

from __future__ import annotations

import functools
import math
import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ndtrain.checkpoint.run_model import build_run_model  # noqa: E402
from ndtrain.config import ModelConfig, ParallelConfig, dump_toml  # noqa: E402
from ndtrain.dist.mesh import ParallelContext, init  # noqa: E402
from ndtrain.engine import Engine  # noqa: E402
from ndtrain.errors import UserError  # noqa: E402
from ndtrain.models.hf import build_hf_model, resolve_attention  # noqa: E402
from ndtrain.run.config_checks import resolve_config  # noqa: E402
from tests.helpers.hf import DTYPE, STEPS, TOL, adamw, batch, hf_dir  # noqa: E402
from tests.helpers.hf_float64 import float64_gemma_norms  # noqa: E402
from tests.helpers.hf_zoo import zoo_config, zoo_model  # noqa: E402
from tests.helpers.parity import assert_params_close  # noqa: E402
from tests.helpers.reference import decay_groups, train_reference  # noqa: E402
from tests.helpers.runner import init_method, run_distributed, run_each  # noqa: E402
from tests.helpers.runs import TINY_ARGS, corpus_file, ndtrain, one_error_line  # noqa: E402

TRAIN_ARGS = [a for a in TINY_ARGS if a not in ("--model", "tiny")] + ["--set", "model.seq_len=32"]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "gemma2"
    zoo_config("gemma2").save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_dir(tmp_path_factory.mktemp("models"), "llama")


def test_auto_picks_what_the_class_supports(gemma2_dir: Path, llama_dir: Path) -> None:
    assert resolve_attention(llama_dir) == "sdpa" and resolve_attention(gemma2_dir) == "eager"
    assert resolve_attention(llama_dir, "eager") == "eager" and resolve_attention(gemma2_dir, "eager") == "eager"
    with pytest.raises(UserError) as refused:
        resolve_attention(gemma2_dir, "sdpa")
    assert str(refused.value) == ("model.attention='sdpa': Gemma2ForCausalLM does not support it (its class sets "
                                  "_supports_sdpa = False): use model.attention=auto or eager")


def test_the_config_records_the_implementation_every_rank_builds(gemma2_dir: Path, llama_dir: Path) -> None:
    cfg = resolve_config(None, {"model.preset": f"hf:{gemma2_dir}"})
    assert cfg.model.attention == "eager" and 'attention = "eager"' in dump_toml(cfg)
    assert resolve_config(None, {"model.preset": f"hf:{llama_dir}", "model.attention": "eager"}).model.attention == "eager"
    with pytest.raises(UserError, match=r"^model\.attention='sdpa': Gemma2ForCausalLM does not support it"):
        resolve_config(None, {"model.preset": f"hf:{gemma2_dir}", "model.attention": "sdpa"})
    with pytest.raises(UserError, match=r"^model\.attention='eager' chooses a Hugging Face model's attention"):
        resolve_config(None, {"model.attention": "eager"})  # the built-in model has its own attention
    assert build_hf_model(llama_dir, 0, "eager").hf.config._attn_implementation == "eager"
    assert build_hf_model(llama_dir, 0).hf.config._attn_implementation == "sdpa"
    assert build_hf_model(gemma2_dir, 0).hf.config._attn_implementation == "eager"


def test_a_worker_building_what_the_class_refuses_raises_a_user_error(gemma2_dir: Path) -> None:
    """The workers' side, whatever the launcher resolved: one line, which failures.py never restarts."""
    with pytest.raises(UserError, match=r"^model\.attention='sdpa': Gemma2ForCausalLM does not support it"):
        build_run_model(ModelConfig(preset=f"hf:{gemma2_dir}", seq_len=32, attention="sdpa"), seed=0)


@pytest.mark.parametrize(("args", "words"), [
    pytest.param(["--set", "model.attention=sdpa"], "model.attention='sdpa': Gemma2ForCausalLM does not support it",
                 id="sdpa"),
    pytest.param(["--cp", "2"], "--cp 2: context parallel is not supported for model_type 'gemma2': its attention "
                                "takes attention logit soft-capping (softcap)", id="cp", marks=pytest.mark.slow),
])
def test_the_launcher_refuses_before_any_worker(args: list[str], words: str, gemma2_dir: Path, tmp_path: Path) -> None:
    """Exit 2, one line, no attempt (no rank log, no restart line): the implementation Gemma2's class refuses,
    and cp for its soft-capped attention (slow: the same check runs in-process in test_hf_declared_pp_cp)."""
    out = tmp_path / "run"
    proc = ndtrain("train", "--nproc", "2", "--max-restarts", "3", "--model", f"hf:{gemma2_dir}",
                   "--data", corpus_file(tmp_path), "--out", str(out), "--steps", "2", *TRAIN_ARGS, *args)
    assert words in one_error_line(proc), proc.stderr
    assert not (out / "logs").exists() and "restarting" not in proc.stderr


# ------------------------------------------------------------------------------------ Gemma2 trains (slow)
MICRO = 2
GEMMA2_LAYOUTS = {"dp2_zero3_recompute": ({"zero": 3, "recompute": "full"}, 2, 2),  # parallel, processes, pieces
                  "dp2_pp2_zero1": ({"pp": 2, "zero": 1, "pp_schedule": "1f1b"}, 4, 4)}


def _gemma2() -> torch.nn.Module:
    model = zoo_model("gemma2")
    assert model.hf.config._attn_implementation == "eager"  # what auto resolves to for Gemma2
    return float64_gemma_norms(model)


def _train_gemma2(ctx: ParallelContext, parallel: ParallelConfig) -> dict[str, Any]:
    engine = Engine(_gemma2, adamw, ctx, parallel)
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    micro = MICRO if parallel.pp > 1 else 1
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
        losses.append(engine.train_step(list(zip(x.chunk(micro), y.chunk(micro)))).loss)
    return {"params": engine.full_state_dict(), "losses": losses}


def _gemma2_suite(layout: str) -> dict[str, Any]:
    parallel = ParallelConfig(**GEMMA2_LAYOUTS[layout][0])
    ctx = init(parallel, init_method=init_method())
    return run_each(lambda name: _train_gemma2(ctx, parallel), [layout])


@functools.cache
def _gemma2_reference(pieces: int) -> dict[str, torch.Tensor]:
    model = _gemma2()
    return train_reference(model, adamw(decay_groups(model)), map(batch, range(STEPS)), pieces=pieces).params


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(GEMMA2_LAYOUTS))
def test_gemma2_trains_like_one_process(layout: str) -> None:
    _, processes, pieces = GEMMA2_LAYOUTS[layout]
    run = [out[layout] for out in run_distributed(_gemma2_suite, processes, layout, timeout=600)]
    got: dict[str, torch.Tensor] = {}
    for out in run:
        got.update(out["params"])
    reference = _gemma2_reference(pieces)
    got = {name: got[name] for name in reference}
    assert {t.dtype for t in got.values()} == {DTYPE}
    worst = assert_params_close(got, reference, TOL, f"gemma2 {layout}")
    print(f"gemma2 {layout}: max relative error {worst:.2e}")
    assert all(out["losses"] == run[0]["losses"] for out in run)


@pytest.mark.slow
def test_gemma2_trains_from_the_command_line(gemma2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = ndtrain("train", "--nproc", "2", "--model", f"hf:{gemma2_dir}", "--data", corpus_file(tmp_path),
                   "--out", str(out), "--steps", "3", "--zero", "3", "--recompute", "full", "--precision", "bf16",
                   *TRAIN_ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'attention = "eager"' in (out / "config.toml").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["final_loss"]) and summary["steps"] == 3, summary
