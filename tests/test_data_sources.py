"""Data sources and tokenizers: the same records through JSONL, Parquet, a saved dataset, CSV and a
renamed text field give identical tokens and windows; HF tokenizers built here train end to end."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from ndtrain.config import DataConfig
from ndtrain.run.config_checks import resolve_config
from ndtrain.data import load_tokenizer, prepare_data
from ndtrain.data.tokenizer import HFTokenizer
from ndtrain.errors import UserError
from tests.helpers.runs import WORDS, texts, train_tokenizer, with_eos, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def write_parquet(path: Path, docs: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=7)
    return path


def write_saved_dataset(path: Path, docs: list[str]) -> Path:
    import datasets

    datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))}).save_to_disk(str(path))
    return path


def write_csv(path: Path, docs: list[str]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "text"])
        writer.writerows(enumerate(docs))
    return path


def data_cfg(path: Path, cache: Path, **kw: object) -> DataConfig:
    return DataConfig(path=str(path), val_fraction=0.25, cache=str(cache), **kw)  # type: ignore[arg-type]


def tokens(data_path: Path, cache: Path, **kw: object) -> tuple[torch.Tensor, torch.Tensor, list]:
    data = prepare_data(data_cfg(data_path, cache, **kw), 8, cache)
    windows = [data.train[i] for i in range(len(data.train))] + [data.val[i] for i in range(len(data.val))]
    return data.file.reader("train")[:].clone(), data.file.reader("val")[:].clone(), windows


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_same_records_in_every_format_give_identical_tokens_and_windows(tmp_path: Path, tokenizer: str) -> None:
    docs = texts()
    spec = "bytes" if tokenizer == "bytes" else f"hf:{with_eos(train_tokenizer(tmp_path / 'tok.json', docs))}"
    sources = {
        "jsonl": (write_jsonl(tmp_path / "d.jsonl", docs), {}),
        "text_field": (write_jsonl(tmp_path / "body.jsonl", docs, field="body"), {"text_field": "body"}),
        "parquet": (write_parquet(tmp_path / "d.parquet", docs), {}),
        "disk": (write_saved_dataset(tmp_path / "saved", docs), {}),
        "csv": (write_csv(tmp_path / "d.csv", docs), {"format": "csv"}),
    }
    results = {name: tokens(path, tmp_path / f"cache-{name}", tokenizer=spec, **kw) for name, (path, kw) in sources.items()}
    train, val, windows = results["jsonl"]
    # the split is the crc32 rule on "line N" names, whatever the format
    tok = load_tokenizer(spec)
    in_val = [zlib.crc32(f"line {i + 1}".encode()) / 2**32 < 0.25 for i in range(len(docs))]
    assert 0 < sum(in_val) < len(docs)
    joined = lambda side: tok.decode(train if side == 0 else val)  # noqa: E731
    if tokenizer == "bytes":
        assert joined(1) == "".join(f"{d}\0" for d, v in zip(docs, in_val) if v)  # each ended by NUL, the EOS
        assert joined(0) == "".join(f"{d}\0" for d, v in zip(docs, in_val) if not v)
    else:
        assert train.dtype == torch.uint16 and len(train) < len("".join(docs))  # merges happened
    for name, (t, v, w) in results.items():
        assert torch.equal(t, train) and torch.equal(v, val), name
        assert len(w) == len(windows) and all(all(map(torch.equal, a, b)) for a, b in zip(w, windows)), name


def test_source_errors_are_one_line(tmp_path: Path) -> None:
    docs = texts(10)
    cases = [
        (write_jsonl(tmp_path / "d.jsonl", docs), {"text_field": "body"}, 'line 1 has no string "body" field'),
        (write_parquet(tmp_path / "d.parquet", docs), {"text_field": "body"}, "has no column 'body'"),
        (write_saved_dataset(tmp_path / "saved", docs), {"text_field": "body"}, "has no column 'body'"),
        (tmp_path / "d.jsonl", {"format": "parquet"}, "not a readable Parquet file"),
        (tmp_path / "d.jsonl", {"format": "yaml"}, "data.format='yaml' is not one of"),
    ]
    for path, kw, message in cases:
        with pytest.raises(UserError, match=message) as e:
            prepare_data(data_cfg(path, tmp_path / "cache", **kw), 8, tmp_path)
        assert "\n" not in str(e.value)


def test_transformers_directory_tokenizer_matches_its_tokenizer_json(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    docs = texts()
    file = train_tokenizer(tmp_path / "tok.json", docs)
    PreTrainedTokenizerFast(tokenizer_file=str(file)).save_pretrained(str(tmp_path / "tokdir"))
    from_file, from_dir = HFTokenizer(f"hf:{file}"), HFTokenizer(f"hf:{tmp_path / 'tokdir'}")
    assert from_file.vocab_size == from_dir.vocab_size == 300
    assert torch.equal(from_file.encode(docs[0]), from_dir.encode(docs[0]))
    assert from_dir.decode(from_dir.encode(docs[0])) == docs[0]


def test_vocab_size_comes_from_the_tokenizer_and_a_smaller_one_is_refused(tmp_path: Path) -> None:
    spec = f"hf:{train_tokenizer(tmp_path / 'tok.json', texts(), kind='wordlevel')}"
    vocab = load_tokenizer(spec).vocab_size
    assert vocab == len(WORDS) + 3  # the words, "." , [UNK] and </s>
    cfg = resolve_config(overrides={"model.preset": "tiny", "data.tokenizer": spec})
    assert cfg.model.vocab_size == vocab
    assert resolve_config(overrides={"data.tokenizer": spec, "model.vocab_size": 500}).model.vocab_size == 500
    with pytest.raises(UserError, match=rf"model.vocab_size=10 is smaller than the {vocab} tokens of data.tokenizer='hf:"):
        resolve_config(overrides={"data.tokenizer": spec, "model.vocab_size": 10})
    with pytest.raises(UserError, match="model.vocab_size=100 is smaller than the byte tokenizer's 256 tokens"):
        resolve_config(overrides={"model.vocab_size": 100})
    for bad, message in [("hf:", "is not 'bytes' or 'hf:PATH'"), ("sentencepiece", "is not 'bytes'"),
                         (f"hf:{tmp_path / 'missing.json'}", "does not exist"),
                         (f"hf:{write_jsonl(tmp_path / 'x.jsonl', ['a'])}", "not a readable tokenizer.json")]:
        with pytest.raises(UserError, match=message):
            resolve_config(overrides={"data.tokenizer": bad})


def test_missing_packages_name_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = f"hf:{train_tokenizer(tmp_path / 'tok.json', texts(10), kind='wordlevel')}"
    parquet = write_parquet(tmp_path / "d.parquet", texts(10))
    for module in ("tokenizers", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    with pytest.raises(UserError, match=r"needs the tokenizers package: pip install ndtrain\[hf\]"):
        load_tokenizer(spec)
    with pytest.raises(UserError, match=r"needs pyarrow: pip install ndtrain\[hf\]"):
        prepare_data(data_cfg(parquet, tmp_path / "c"), 8, tmp_path)
    with pytest.raises(UserError, match=r"needs the datasets package: pip install ndtrain\[hf\]"):
        prepare_data(data_cfg(parquet, tmp_path / "c", format="csv"), 8, tmp_path)


def ndtrain(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "ndtrain", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_hf_tokenizer_trains_end_to_end_and_generate_decodes_with_it(tmp_path: Path) -> None:
    docs = texts(300)
    spec = f"hf:{with_eos(train_tokenizer(tmp_path / 'tok.json', docs, kind='wordlevel'))}"
    write_jsonl(tmp_path / "d.jsonl", docs)
    common = ["--model", "tiny", "--data", "d.jsonl", "--set", f"data.tokenizer={spec}", "--set", "log.progress=false",
              "--set", "data.eval_samples=4", "--set", "schedule.global_batch=4", "--set", "schedule.micro_batch=2"]
    proc = ndtrain("train", *common, "--steps", "3", "--nproc", "1", "--out", "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokenizer hf:" in proc.stdout + proc.stderr
    config = (tmp_path / "run" / "config.toml").read_text()
    assert f"vocab_size = {len(WORDS) + 3}" in config and f'tokenizer = "{spec}"' in config
    out = ndtrain("generate", "run", "--prompt", "the quick", "--max-new-tokens", "12", "--temperature", "0",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    words = out.stdout.split()
    assert words[:2] == ["the", "quick"] and len(words) == 14 and set(words) <= {*WORDS, ".", "[UNK]"}, out.stdout
    refused = ndtrain("train", *common, "--set", "model.vocab_size=10", "--out", "run2", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "model.vocab_size=10 is smaller" in refused.stderr
