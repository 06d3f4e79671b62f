"""`--model hf:PATH`: tiny Llama, Qwen2 and GPT-2 from configs written here, trained by ndtrain.

Seeded init identical on every build, weights loaded when the folder has them, sizes taken from
config.json, the launcher's refusals, and dp=2 training equal to one process (fp32,
relative error ≤ 1e-5 per tensor) through the Trainer and through `ndtrain train --model hf:DIR`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ndtrain.config import ParallelConfig
from ndtrain.run.config_checks import parameter_count, resolve_config
from ndtrain.errors import UserError
from ndtrain.checkpoint.run_model import load_run
from ndtrain.dist.mesh import init
from ndtrain.models.hf import build_hf_model, check_family_supports, check_hf_model
from ndtrain.trainer import Trainer
from tests.helpers.hf import hf_dir, hf_run_config, transformers
from tests.helpers.parity import assert_params_close
from tests.helpers.runner import init_method, run_distributed
from tests.helpers.runs import corpus_file, ndtrain

FAMILIES = ("llama", "qwen2", "gpt2")
TOL = 1e-5


def train(cfg) -> dict[str, torch.Tensor]:
    ctx = init(cfg.parallel, init_method=init_method()) if cfg.parallel.dp != 1 else init(cfg.parallel)
    trainer = Trainer(cfg, ctx)
    trainer.run()
    return trainer.engine.full_state_dict()


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_init_is_identical_and_weights_are_loaded(tmp_path: Path, family: str) -> None:
    path = hf_dir(tmp_path, family)
    a, b, c = build_hf_model(path, 7), build_hf_model(path, 7), build_hf_model(path, 8)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.state_dict()["hf.lm_head.weight"], c.state_dict()["hf.lm_head.weight"])
    assert next(a.parameters()).dtype == torch.float32
    saved = hf_dir(tmp_path, family, weights=c.hf)
    loaded = build_hf_model(saved, 7)  # weights present: the seed does not matter
    for name, tensor in c.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_sizes_come_from_config_json(tmp_path: Path) -> None:
    path = hf_dir(tmp_path, "gpt2")
    cfg = resolve_config(None, {"model.preset": f"hf:{path}", "model.seq_len": 48})
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size, m.tie_embeddings, m.seq_len) == \
        (32, 2, 4, 4, 128, 256, True, 48)
    assert m.preset == f"hf:{path.resolve()}"
    assert parameter_count(m) == sum(p.numel() for p in build_hf_model(path, 0).parameters())
    with pytest.raises(UserError, match=r"model.dim=64 differs from 32 .* drop model.dim"):
        resolve_config(None, {"model.preset": f"hf:{path}", "model.dim": 64})
    with pytest.raises(UserError, match=r"model.seq_len=65 exceeds the 64 positions .* use model.seq_len <= 64"):
        resolve_config(None, {"model.preset": f"hf:{path}", "model.seq_len": 65})
    with pytest.raises(UserError, match="no config.json"):
        resolve_config(None, {"model.preset": f"hf:{tmp_path}"})


def train_float64(cfg, model_dir: Path) -> dict[str, torch.Tensor]:
    """Train the HF model of `model_dir` in float64 through `Trainer(cfg, model_fn=...)`."""
    ctx = init(cfg.parallel, init_method=init_method()) if cfg.parallel.dp != 1 else init(cfg.parallel)
    trainer = Trainer(cfg, ctx, model_fn=lambda: build_hf_model(model_dir, cfg.seed).double())
    trainer.run()
    return trainer.engine.full_state_dict()


def _dp_worker(data: str, out: str, dirs: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    return {family: train_float64(hf_run_config(data, f"{out}/{family}", Path(path), **{"schedule.micro_batch": 2}),
                                  Path(path))
            for family, path in dirs.items()}


@pytest.mark.slow  # ~25 s each; the CLI test below is the fast dp=2 check
@pytest.mark.parametrize("families", [("llama",), ("qwen2", "gpt2")], ids=["llama", "qwen2+gpt2"])
def test_dp2_training_equals_single_process(tmp_path: Path, families: tuple[str, ...], one_thread: None) -> None:
    """Through `Trainer(cfg, model_fn=...)` in float64, as the other parity tests (README, Tests): in fp32
    the layouts sum micro-batch gradients in different orders and AdamW's division by sqrt(v) lifted
    that to 1.07e-5 on one tensor here; the CLI test below checks fp32."""
    data = corpus_file(tmp_path)
    dirs = {family: str(hf_dir(tmp_path, family)) for family in families}
    ranks = run_distributed(_dp_worker, 2, data, str(tmp_path / "dp2"), dirs)
    for family, path in dirs.items():
        reference = train_float64(hf_run_config(data, str(tmp_path / f"ref-{family}"), Path(path),
                                                **{"parallel.dp": 1, "schedule.micro_batch": 8}), Path(path))
        initial = build_hf_model(Path(path), 0).state_dict()["hf.lm_head.weight"].double()
        assert reference["hf.lm_head.weight"].dtype == torch.float64
        assert not torch.allclose(reference["hf.lm_head.weight"], initial, rtol=0, atol=1e-4)  # it trained
        assert_params_close(ranks[0][family], reference, TOL, f"{family} dp=2")
        assert all(torch.equal(ranks[0][family][k], ranks[1][family][k]) for k in reference)


CLI_TINY = ["--set", "schedule.global_batch=8", "--set", "schedule.micro_batch=2", "--set", "log.progress=false",
            "--set", "data.eval_samples=8", "--set", "log.eval_every=0", "--set", "model.seq_len=32",
            # fp32 (the CLI has no float64): AdamW's m/(sqrt(v)+eps) turns summation-order rounding of a
            # near-zero gradient element into a full-size update difference; eps 1e-4 keeps that
            # proportional, so the 1e-5 bound does not depend on the CPU's kernels
            "--set", "optim.eps=1e-4"]


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("gpt2", marks=pytest.mark.slow)])
def test_cli_trains_hf_model_on_two_processes_like_one(tmp_path: Path, family: str, one_thread: None) -> None:
    data = corpus_file(tmp_path)
    path = hf_dir(tmp_path, family)
    run = tmp_path / "run"
    proc = ndtrain("train", "--model", f"hf:{path}", "--nproc", "2", "--data", data, "--out", str(run),
                   "--steps", "5", *CLI_TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"model hf:{path.resolve()} ({family})" in proc.stdout
    reference = train(resolve_config(run / "config.toml", {"parallel.dp": 1, "schedule.micro_batch": 8,
                                                         "log.out": str(tmp_path / "ref")}))
    _, model, checkpoint = load_run(run)
    assert checkpoint.name == "step_00000005"
    assert_params_close(model.state_dict(), reference, TOL, f"ndtrain train --model hf: ({family}) dp=2")


def test_cli_check_and_refusals(tmp_path: Path) -> None:
    path = hf_dir(tmp_path, "llama")
    proc = ndtrain("train", "--check", "--model", f"hf:{path}", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f'preset = "hf:{path.resolve()}"' in proc.stdout and "dim = 32" in proc.stdout
    assert "seq_len = 64" in proc.stdout  # min(128, max_position_embeddings)
    with pytest.raises(UserError, match="no config.json"):
        resolve_config(None, {"model.preset": f"hf:{tmp_path}"})
    with pytest.raises(UserError, match=r"is not a directory: give a folder"):
        resolve_config(None, {"model.preset": f"hf:{tmp_path / 'absent'}"})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "no-such-family", "hidden_size": 8, '
                                                  '"num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 256}')
    with pytest.raises(UserError, match="transformers cannot read its config.json"):
        check_hf_model(tmp_path / "bad", 32)
    # The layout is checked against the family before any worker starts.
    gpt2 = hf_dir(tmp_path, "gpt2")
    proc = ndtrain("train", "--check", "--model", f"hf:{gpt2}", "--nproc", "3", "--tp", "3", "--out", str(tmp_path / "r2"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--tp 3: " in proc.stderr and "not divisible by tp=3" in proc.stderr  # c_attn's q, k, v of 32 features
    # Falcon's config declares no plans: each model-parallel axis is refused naming itself; Mistral
    # declares both (base_model_tp_plan, base_model_pp_plan): every axis is accepted.
    falcon = transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    mistral = transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    with torch.device("meta"):
        falcon_model = transformers.AutoModelForCausalLM.from_config(falcon)
        mistral_model = transformers.AutoModelForCausalLM.from_config(mistral)
    for axis, what in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context")):
        with pytest.raises(UserError, match=rf"^--{axis} 2: {what} parallel is not supported for model type 'falcon': "
                                            r"its config declares no pipeline plan .*use dp/ZeRO"):
            check_family_supports(falcon_model, ParallelConfig(**{axis: 2}))
    check_family_supports(mistral_model, ParallelConfig(tp=2, pp=2, cp=2))


def test_missing_transformers_is_one_line_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = hf_dir(tmp_path, "llama")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(UserError, match=r"needs the transformers package: pip install 'ndtrain\[hf\]'"):
        check_hf_model(path, 32)
    with pytest.raises(UserError, match="pip install"):
        build_hf_model(path, 0)
