"""The tokenizer that belongs to the model (issue 30, item 4): `--model hf:DIR` trains with DIR's own
tokenizer unless data.tokenizer names one; a tokenizer larger than the model's embedding is refused in
one line before any worker starts; exports carry the run's tokenizer (a byte run's as a byte-level
tokenizer mapping text to ndtrain's ids); the loss's unit is nats/byte only for bytes; config.toml
records the HF model's own config values. Everything is built here: a tiny Llama with seeded weights and
a BPE tokenizer trained on generated text, saved together with save_pretrained."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ndtrain.checkpoint.export import export_safetensors
from ndtrain.checkpoint.export_hf import export_hf
from ndtrain.checkpoint.run_model import load_run
from ndtrain.config import dump_toml
from ndtrain.data.tokenizer import ByteTokenizer, folder_tokenizer, load_tokenizer
from ndtrain.dist.mesh import init
from ndtrain.errors import UserError
from ndtrain.report.page import run_loss_unit, write_report
from ndtrain.run.config_checks import resolve_config
from ndtrain.run.metrics import uniform_label
from ndtrain.run.tasks import loss_unit
from ndtrain.trainer import Trainer
from tests.helpers.runs import corpus_file, ndtrain, one_error_line, tiny_config, write_jsonl

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SYLLABLES = "ka lo mi ne su ta ri po ve zu da fe gi ho ju".split()
# the model's own config values, none of them ndtrain's defaults (1e-5, 10000, 0.02)
ROPE_THETA, NORM_EPS, INIT_STD = 50000.0, 1e-6, 0.03
RUN = ["--nproc", "1", "--steps", "2", "--set", "model.seq_len=32", "--set", "schedule.global_batch=4",
       "--set", "schedule.micro_batch=2", "--set", "data.eval_samples=4", "--set", "log.progress=false",
       "--set", "log.log_every=1", "--set", "log.eval_every=0"]
ODD_TEXT = " héllo\n\twörld 🙂  x\x00\x7f ∑ end "


def documents(count: int = 400, seed: int = 0) -> list[str]:
    """Sentences of words made of 1-3 syllables: ~1,000 distinct words, enough for ~200 BPE tokens."""
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
    return [" ".join(word() for _ in range(rng.randint(5, 30))) + "." for _ in range(count)]


def bpe(docs: list[str], vocab: int) -> object:
    """A byte-level BPE trained here on `docs` (its alphabet: the characters they hold)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(docs, tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["</s>"],
                                                                 show_progress=False))
    return tok


def llama(vocab: int = 256) -> object:
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
                                    rope_theta=ROPE_THETA, rms_norm_eps=NORM_EPS, initializer_range=INIT_STD)


def pretrained(path: Path, tokenizer: object | None, vocab: int = 256) -> Path:
    """A folder as a pretrained model ships: seeded weights, config.json and (given one) the tokenizer."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(llama(vocab)).save_pretrained(str(path))
    if tokenizer is not None:
        transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>").save_pretrained(str(path))
    return path.resolve()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    """(pretrained model folder with its ~200-token tokenizer, a JSONL corpus, that tokenizer)."""
    root = tmp_path_factory.mktemp("pretrained")
    docs = documents()
    tok = bpe(docs, 200)
    return pretrained(root / "model", tok), write_jsonl(root / "d.jsonl", docs), tok


def config(model: Path, **overrides: object) -> object:
    return resolve_config(None, {"model.preset": f"hf:{model}", "model.seq_len": 32, **overrides})


# ------------------------------------------------------------------------------------ resolution
def test_the_model_folders_tokenizer_is_the_default_and_an_explicit_one_wins(
        folder: tuple[Path, Path, object], tmp_path: Path) -> None:
    model, _, tok = folder
    assert 150 <= tok.get_vocab_size() <= 256  # a real BPE, smaller than the 256 embedding rows
    assert config(model).data.tokenizer == f"hf:{model}"
    assert config(model, **{"data.tokenizer": "bytes"}).data.tokenizer == "bytes"
    other = tmp_path / "other.json"
    bpe(documents(seed=1), 180).save(str(other))
    assert config(model, **{"data.tokenizer": f"hf:{other}"}).data.tokenizer == f"hf:{other}"
    bare = pretrained(tmp_path / "bare", None)
    assert folder_tokenizer(bare) is None and config(bare).data.tokenizer == "bytes"


def test_config_toml_records_the_models_own_config_values(folder: tuple[Path, Path, object], tmp_path: Path) -> None:
    model, _, _ = folder
    cfg = config(model)
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (32, 2, 4, 2, 64, 256)
    assert (m.rope_theta, m.norm_eps, m.init_std) == (ROPE_THETA, NORM_EPS, INIT_STD)
    assert f"rope_theta = {ROPE_THETA}" in dump_toml(cfg) and "norm_eps = 1e-06" in dump_toml(cfg)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                            layer_norm_epsilon=1e-4, initializer_range=0.05).save_pretrained(str(gpt2))
    g = config(gpt2).model
    assert (g.norm_eps, g.init_std, g.tie_embeddings) == (1e-4, 0.05, True)
    with pytest.raises(UserError, match=r"model.norm_eps=1e-05 differs from 1e-06 in .*config.json.*drop model"):
        config(model, **{"model.norm_eps": 1e-5})
    assert config(model, **{"model.rope_theta": ROPE_THETA}).model.rope_theta == ROPE_THETA  # repeating it is fine


@pytest.mark.slow  # make test's 20 minutes; the refusal's rule is in run/config_checks.py, tested here
def test_a_tokenizer_larger_than_the_embedding_is_refused(folder: tuple[Path, Path, object], tmp_path: Path) -> None:
    model, corpus, _ = folder
    big = tmp_path / "big.json"
    tok = bpe(documents(seed=2), 300)
    assert tok.get_vocab_size() > 256
    tok.save(str(big))
    with pytest.raises(UserError, match=rf"model.vocab_size=256 is smaller than the {tok.get_vocab_size()} tokens of "
                       rf"data.tokenizer='hf:{big}': the model in '{model}' has 256 embedding rows; leave "
                       rf"data.tokenizer out to use the model's own \(hf:{model}\), or give data.tokenizer one of at "
                       rf"most 256 tokens, or bytes"):
        config(model, **{"data.tokenizer": f"hf:{big}"})
    small = pretrained(tmp_path / "small", bpe(documents(seed=3), 200), vocab=128)  # its own tokenizer does not fit
    with pytest.raises(UserError, match=r"model.vocab_size=128 is smaller .* 128 embedding rows; give data.tokenizer"):
        config(small)
    out = tmp_path / "run"
    line = one_error_line(ndtrain("train", "--model", f"hf:{model}", "--set", f"data.tokenizer=hf:{big}",
                                  "--data", str(corpus), "--out", str(out), *RUN))
    assert "embedding rows" in line and not out.exists()  # refused by the launcher: nothing written, no worker


# ------------------------------------------------------------------------------------ the acceptance run
def test_fine_tune_through_the_cli_starts_as_with_the_named_tokenizer_and_exports_it(
        folder: tuple[Path, Path, object], tmp_path: Path, one_thread: None) -> None:
    model, corpus, tok = folder
    run = tmp_path / "cli"
    proc = ndtrain("train", "--model", f"hf:{model}", "--data", str(corpus), "--out", str(run), *RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert f"tokenizer hf:{model} (the model's own)" in said and "nats/token" in said and "nats/byte" not in said
    assert f'tokenizer = "hf:{model}"' in (run / "config.toml").read_text()
    named = tiny_config(str(corpus), str(tmp_path / "named"), **{
        "model.preset": f"hf:{model}", "model.seq_len": 32, "data.tokenizer": f"hf:{model}", "schedule.steps": 1,
        "schedule.global_batch": 4, "schedule.micro_batch": 2, "data.eval_samples": 4})
    Trainer(named, init(named.parallel)).run()
    first = lambda path: json.loads(path.read_text().splitlines()[0])["loss"]
    cli_loss, named_loss = first(run / "metrics.jsonl"), first(tmp_path / "named" / "metrics.jsonl")
    assert abs(cli_loss - named_loss) <= 1e-6 * named_loss, (cli_loss, named_loss)
    assert json.loads((run / "summary.json").read_text())["loss_unit"] == "nats/token"
    assert "loss in nats/token" in write_report(run).read_text()

    out = tmp_path / "exported"
    export_hf(run, out)
    loaded = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    text = documents(1, seed=9)[0]
    assert loaded(text)["input_ids"] == tok.encode(text).ids == load_tokenizer(f"hf:{model}").encode(text).tolist()
    _, ours, _ = load_run(run)
    ids = torch.tensor([tok.encode(text).ids[:32]])
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
        assert torch.equal(theirs(input_ids=ids).logits, ours(ids))
    assert config(out).data.tokenizer == f"hf:{out.resolve()}"  # fine-tuning the export keeps its tokenizer
    export_safetensors(run, tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["tokenizer"] == f"hf:{model}"
    assert tokenizers.Tokenizer.from_str(meta["tokenizer_json"]).encode(text).ids == tok.encode(text).ids


# ------------------------------------------------------------------------------------ bytes
def test_a_byte_run_exports_a_byte_tokenizer_with_ndtrains_ids(tmp_path: Path, one_thread: None) -> None:
    cfg = tiny_config(corpus_file(tmp_path), str(tmp_path / "run"), **{"schedule.steps": 1})
    Trainer(cfg, init(cfg.parallel)).run()
    out = tmp_path / "exported"
    _, files = export_hf(Path(cfg.log.out), out)
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= set(files)
    loaded = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    every_byte = bytes(range(256)).decode("latin-1")
    for text in (ODD_TEXT, every_byte, ""):
        ids = ByteTokenizer().encode(text).tolist()
        assert loaded(text)["input_ids"] == ids == list(text.encode("utf-8"))
        assert loaded.decode(ids) == text
    assert loaded.decode([0xE2, 0x82, 0x68]) == ByteTokenizer().decode([0xE2, 0x82, 0x68])  # a cut character
    assert len(loaded) == 256
    assert folder_tokenizer(out.resolve()) == "bytes" and config(out).data.tokenizer == "bytes"
    export_safetensors(Path(cfg.log.out), tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata()["tokenizer"] == "bytes" and "tokenizer_json" not in f.metadata()
    assert json.loads((Path(cfg.log.out) / "summary.json").read_text())["loss_unit"] == "nats/byte"


def test_a_near_byte_tokenizer_is_not_taken_for_bytes(tmp_path: Path) -> None:
    """Only ndtrain's exact byte ids count as bytes: a prefix space or one merge makes it another tokenizer."""
    ByteTokenizer().save_pretrained(tmp_path / "exact")
    assert folder_tokenizer(tmp_path / "exact") == "bytes"
    for name, change in (("prefix", lambda t: t["pre_tokenizer"].update(add_prefix_space=True)),
                         ("merge", lambda t: t["model"].update(merges=[["a", "b"]]))):
        folder = tmp_path / name
        folder.mkdir()
        saved = json.loads((tmp_path / "exact" / "tokenizer.json").read_text())
        change(saved)
        (folder / "tokenizer.json").write_text(json.dumps(saved))
        assert folder_tokenizer(folder) == f"hf:{folder}"


def test_a_model_folders_tokenizer_identity_leaves_its_weights_out(folder: tuple[Path, Path, object],
                                                                   tmp_path: Path) -> None:
    model, _, tok = folder
    copy = pretrained(tmp_path / "copy", tok)
    before = load_tokenizer(f"hf:{copy}").identity()["sha256"]
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")  # fine-tuned weights, same tokenizer
    assert load_tokenizer(f"hf:{copy}").identity()["sha256"] == before
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe(documents(seed=5), 200)).save_pretrained(str(copy))
    assert load_tokenizer(f"hf:{copy}").identity()["sha256"] != before


# ------------------------------------------------------------------------------------ units
def test_the_loss_unit_is_per_byte_only_for_the_byte_tokenizer() -> None:
    assert loss_unit("small", "bytes") == "nats/byte"
    assert loss_unit("hf:/m", "hf:/m") == loss_unit("tiny", "hf:tok.json") == "nats/token"
    assert loss_unit("hf:/m", "bytes") == "nats/byte" and loss_unit("digits", "bytes") == "nats"
    assert uniform_label("nats/token", 200) == "ln 200 (uniform over 200 tokens)"
    assert uniform_label("nats/byte", 256) == "ln 256 (uniform over 256 bytes)"
    # a report made while the run goes on (no summary.json) reads the unit from config.toml
    hf_run = {"model": {"preset": "hf:/m"}, "data": {"tokenizer": "hf:/m"}}
    assert run_loss_unit("no summary.json", hf_run) == "nats/token"
    assert run_loss_unit("no summary.json", {"model": {"preset": "small"}}) == "nats/byte"
    assert run_loss_unit({"loss_unit": "nats"}, None) == "nats"
