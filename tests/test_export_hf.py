"""Weights out and in: `ndtrain export --format hf` → `from_pretrained` gives ndtrain's logits (≤ 1e-5),
and `--init-from` (an exported folder or .safetensors file) starts a run from exactly those weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ndtrain.config import TrainConfig
from ndtrain.run.config_checks import resolve_config
from ndtrain.errors import UserError
from ndtrain.checkpoint.export import export_safetensors
from ndtrain.checkpoint.export_hf import export_hf
from ndtrain.models.llama_hf import builtin_to_hf
from ndtrain.checkpoint.run_model import load_run
from ndtrain.data.tokenizer import load_tokenizer
from ndtrain.checkpoint.init_from import load_init_weights
from ndtrain.run.inspect import inspect_run
from ndtrain.dist.mesh import init
from ndtrain.checkpoint.run_model import build_run_model
from ndtrain.models.llama import build_model
from ndtrain.trainer import Trainer
from tests.helpers.hf import hf_dir, hf_run_config, transformers
from tests.helpers.runs import corpus_file, ndtrain, texts, tiny_config, train_tokenizer, with_eos, write_jsonl

TOL = 1e-5
TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def logits(model: torch.nn.Module) -> torch.Tensor:
    """ndtrain models take tokens; transformers models input_ids."""
    with torch.no_grad():
        if isinstance(model, transformers.PreTrainedModel):
            return model(input_ids=TOKENS).logits
        return model(TOKENS)


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err <= TOL, f"logits differ by {err:.3e} (relative)"


def trained_run(tmp_path: Path, cfg: TrainConfig) -> Path:
    Trainer(cfg, init(cfg.parallel)).run()
    return Path(cfg.log.out)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_builtin_llama_is_llama_for_causal_lm(tied: bool) -> None:
    """Same RoPE convention (halves, as rotate_half): a renaming, no q/k permutation."""
    cfg = resolve_config(None, {"model.preset": "tiny", "model.tie_embeddings": tied, "model.init_std": 0.2})
    model = build_model(cfg.model, 3).eval()
    assert_same_logits(logits(builtin_to_hf(model, cfg.model)), logits(model))


def test_builtin_run_exports_to_hf_and_init_from_reproduces_it(tmp_path: Path, one_thread: None) -> None:
    run = trained_run(tmp_path, tiny_config(corpus_file(tmp_path), str(tmp_path / "run"),
                                            **{"parallel.dp": 1, "schedule.steps": 3}))
    out = tmp_path / "exported"
    checkpoint, _ = export_hf(run, out)
    assert checkpoint.name == "step_00000003"
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {p.name for p in out.iterdir()}
    cfg, ours, _ = load_run(run)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert type(theirs).__name__ == "LlamaForCausalLM"
    assert_same_logits(logits(theirs), logits(ours))
    export_safetensors(run, tmp_path / "model.safetensors")
    for source in (out, tmp_path / "model.safetensors"):
        start = build_run_model(resolve_config(None, {"model.preset": "tiny", "model.init_from": str(source)}).model, 99)
        assert_same_logits(logits(start), logits(ours))
    with pytest.raises(UserError, match="already exists: give a new folder name"):
        export_hf(run, out)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_run_exports_to_hf_and_init_from_reproduces_it(tmp_path: Path, family: str, one_thread: None) -> None:
    model_dir = hf_dir(tmp_path, family)
    run = trained_run(tmp_path, hf_run_config(corpus_file(tmp_path), str(tmp_path / "run"), model_dir,
                                              **{"parallel.dp": 1, "schedule.steps": 2}))
    out = tmp_path / "exported"
    checkpoint, files = export_hf(run, out)
    assert checkpoint.name == "step_00000002" and "model.safetensors" in files
    assert not out.with_name(out.name + ".partial").exists()
    cfg, ours, _ = load_run(run)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert_same_logits(logits(theirs), logits(ours))
    assert f"model       hf:{model_dir.resolve()} ({family})" in inspect_run(run)
    fresh = build_run_model(cfg.model, cfg.seed)
    assert not torch.allclose(logits(fresh), logits(ours))  # training moved the weights
    export_safetensors(run, tmp_path / "model.safetensors")
    for source in (out, tmp_path / "model.safetensors"):
        start = build_run_model(resolve_config(None, {"model.preset": f"hf:{model_dir}", "model.seq_len": 32,
                                                   "model.init_from": str(source)}).model, 99)
        assert_same_logits(logits(start), logits(ours))


def test_init_from_refuses_other_models(tmp_path: Path) -> None:
    tiny = resolve_config(None, {"model.preset": "tiny"}).model
    model = build_model(tiny, 0)
    qwen = hf_dir(tmp_path, "qwen2", weights=build_run_model(
        resolve_config(None, {"model.preset": f"hf:{hf_dir(tmp_path, 'qwen2')}"}).model, 0).hf)
    with pytest.raises(UserError, match=r"does not fit this model: .*unexpected model\.layers\.0\.self_attn\.k_proj\.bias, .* \(\+2 more\)"):
        load_init_weights(model, qwen)
    other = build_model(resolve_config(None, {"model.preset": "tiny", "model.dim": 64}).model, 0)
    export = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(export))
    with pytest.raises(UserError, match=r"shapes differ: tok_embeddings.weight \(256, 64\) vs \(256, 32\)"):
        load_init_weights(model, export)
    with pytest.raises(UserError, match="holds no model.safetensors"):
        load_init_weights(model, tmp_path)
    with pytest.raises(UserError, match="model.init_from .* does not exist"):
        resolve_config(None, {"model.preset": "tiny", "model.init_from": str(tmp_path / "absent")})


def test_export_writes_the_runs_hf_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    words = "the quick brown fox jumps over the lazy dog".split()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])},
                                                                 unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    load_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}").save_pretrained(tmp_path / "out")
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert loaded("the lazy fox")["input_ids"] == tokenizer.encode("the lazy fox").ids


def test_hf_model_with_hf_tokenizer_trains_through_the_cli_and_exports_both(tmp_path: Path) -> None:
    docs = texts(300)
    tokenizer_file = with_eos(train_tokenizer(tmp_path / "tok.json", docs))  # byte-level BPE, 300 tokens
    write_jsonl(tmp_path / "d.jsonl", docs)
    model_dir = tmp_path / "llama320"
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=320, max_position_embeddings=64).save_pretrained(model_dir)
    with pytest.raises(UserError, match=r"model.vocab_size=256 is smaller than the 300 tokens of data.tokenizer"):
        resolve_config(None, {"model.preset": f"hf:{hf_dir(tmp_path, 'llama')}", "data.tokenizer": f"hf:{tokenizer_file}"})
    run = tmp_path / "run"
    proc = ndtrain("train", "--model", f"hf:{model_dir}", "--set", f"data.tokenizer=hf:{tokenizer_file}",
                   "--data", str(tmp_path / "d.jsonl"), "--nproc", "1", "--steps", "2", "--out", str(run),
                   "--set", "model.seq_len=32", "--set", "schedule.global_batch=4", "--set", "schedule.micro_batch=2",
                   "--set", "data.eval_samples=4", "--set", "log.progress=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(llama)" in proc.stdout and "vocab_size = 320" in (run / "config.toml").read_text()
    out = tmp_path / "exported"
    proc = ndtrain("export", str(run), str(out), "--format", "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_00000002" in proc.stdout and "Writing" not in proc.stderr  # no progress bar
    files = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors", "config.json"} <= files
    loaded = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    sentence = docs[0]
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(tokenizer_file / "tokenizer.json"))
    assert loaded(sentence)["input_ids"] == saved.encode(sentence).ids
    _, ours, _ = load_run(run)
    assert_same_logits(logits(transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)),
                       logits(ours))
