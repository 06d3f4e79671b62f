"""Token files: built once and reused, dtype from the vocabulary, rebuilt when stale or corrupt,
streamed in chunks, exact on reopen (resume), and a rank's resident memory bounded on a 500 MB corpus."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from ndtrain.config import DataConfig
from ndtrain.data import DistributedSampler, load_corpus, load_tokenizer, prepare_data
from ndtrain.data import sources as sources_module
from ndtrain.data import token_file as token_file_module
from ndtrain.data.tokenizer import token_format
from tests.helpers.runner import run_distributed

WORDS = "the a fox dog cat runs jumps over under lazy quick brown red green sees eats".split()


def texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) + "." for _ in range(count)]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return path


def wordlevel(path: Path, words: list[str]) -> str:
    """A WordLevel tokenizer folder over `words` (id = position + 1, [UNK] = 0, its end-of-sequence token
    "</s>" the last id): any vocabulary size, no training."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}, "</s>": len(words) + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(path))
    return f"hf:{path}"


def cfg(path: Path, cache: Path, **kw: object) -> DataConfig:
    return DataConfig(path=str(path), val_fraction=0.2, cache=str(cache), **kw)  # type: ignore[arg-type]


def mtimes(folder: Path) -> dict[str, int]:
    return {name: (folder / name).stat().st_mtime_ns for name in ("train.bin", "val.bin", "meta.json")}


def test_built_once_then_reused_and_equal_to_the_in_memory_corpus(tmp_path: Path) -> None:
    data_path = write_jsonl(tmp_path / "d.jsonl", texts(60))
    first = prepare_data(cfg(data_path, tmp_path / "cache"), 16, tmp_path / "run")
    assert first.file.built and "(built)" in first.description
    stamps = mtimes(tmp_path / "cache")
    for verify in (False, True):
        again = prepare_data(cfg(data_path, tmp_path / "cache"), 16, tmp_path / "run", verify=verify)
        assert not again.file.built and "(reused)" in again.description
        assert mtimes(tmp_path / "cache") == stamps
    corpus = load_corpus(str(data_path), 0.2)  # the in-memory byte corpus: same rule, same bytes
    assert torch.equal(first.file.reader("train")[:], corpus.train) and torch.equal(first.file.reader("val")[:], corpus.val)
    assert first.file.meta["train_documents"] == corpus.train_documents
    default = prepare_data(DataConfig(path=str(data_path), val_fraction=0.2), 16, tmp_path / "run")
    assert default.file.folder == tmp_path / "run" / "data" and torch.equal(default.file.reader("val")[:], corpus.val)


@pytest.mark.parametrize("vocab, code, dtype", [(256, "B", torch.uint8), (300, "H", torch.uint16),
                                                (70_000, "I", torch.uint32)])
def test_token_dtype_follows_the_vocabulary(tmp_path: Path, vocab: int, code: str, dtype: torch.dtype) -> None:
    extra = [f"w{i}" for i in range(vocab - 1 - len(WORDS) - 2)]  # vocab = [UNK] + extra + words + "." + </s>
    spec = "bytes" if vocab == 256 else wordlevel(tmp_path / "tok", [*extra, *WORDS, "."])
    tokenizer = load_tokenizer(spec)
    assert tokenizer.vocab_size == vocab and token_format(vocab) == code
    data_path = write_jsonl(tmp_path / "d.jsonl", texts(40))
    data = prepare_data(cfg(data_path, tmp_path / "cache", tokenizer=spec), 8, tmp_path)
    train = data.file.reader("train")[:]
    assert data.file.meta["dtype"] == code and train.dtype == dtype
    assert (tmp_path / "cache" / "train.bin").stat().st_size == len(train) * train.element_size()
    eos = tokenizer.eos_token_id
    assert int((train == eos).sum()) == data.file.meta["train_documents"]  # every document ends with EOS
    if vocab > 256:
        assert set(tokenizer.decode(train).split()) == {*WORDS, ".", "</s>"}
    if vocab > 65536:
        assert int(train.long().max()) > 65535  # the words sit above the extra ids: uint16 could not hold them


def corrupt_truncate(folder: Path, data_path: Path) -> None:
    with open(folder / "train.bin", "r+b") as f:
        f.truncate(10)


def corrupt_flip(folder: Path, data_path: Path) -> None:
    raw = bytearray((folder / "val.bin").read_bytes())
    raw[3] ^= 0xFF
    (folder / "val.bin").write_bytes(bytes(raw))


def corrupt_meta(folder: Path, data_path: Path) -> None:
    (folder / "meta.json").write_text("{not json")


def flip_docs(folder: Path, data_path: Path) -> None:
    raw = bytearray((folder / "train.docs").read_bytes())
    raw[9] ^= 0xFF  # the second document's start
    (folder / "train.docs").write_bytes(bytes(raw))


def delete_val(folder: Path, data_path: Path) -> None:
    (folder / "val.bin").unlink()


def change_source(folder: Path, data_path: Path) -> None:
    write_jsonl(data_path, texts(61))
    os.utime(data_path, ns=(1, 1))


@pytest.mark.parametrize("damage", [corrupt_truncate, corrupt_flip, flip_docs, corrupt_meta, delete_val,
                                    change_source])
def test_a_stale_or_corrupt_cache_is_rebuilt(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    data_path = write_jsonl(tmp_path / "d.jsonl", texts(60))
    folder = tmp_path / "cache"
    prepare_data(cfg(data_path, folder), 16, tmp_path)
    damage(folder, data_path)
    rebuilt = prepare_data(cfg(data_path, folder), 16, tmp_path, verify=True)  # the launcher's check
    assert rebuilt.file.built
    expected = load_corpus(str(data_path), 0.2)
    assert torch.equal(rebuilt.file.reader("train")[:], expected.train)
    assert torch.equal(rebuilt.file.reader("val")[:], expected.val)
    assert not list(folder.glob(".building-*"))  # the work folder is gone
    assert not prepare_data(cfg(data_path, folder), 16, tmp_path).file.built


def test_another_tokenizer_or_split_rebuilds(tmp_path: Path) -> None:
    data_path = write_jsonl(tmp_path / "d.jsonl", texts(60))
    folder = tmp_path / "cache"
    prepare_data(cfg(data_path, folder), 16, tmp_path)
    spec = wordlevel(tmp_path / "tok", [*WORDS, "."])
    assert prepare_data(cfg(data_path, folder, tokenizer=spec), 4, tmp_path).file.built
    assert prepare_data(DataConfig(path=str(data_path), val_fraction=0.3, cache=str(folder), tokenizer=spec), 4,
                        tmp_path).file.built


def test_text_file_streams_in_chunks_and_splits_by_token_position(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    content = "\n".join(texts(200)) + "\nno newline at the end"
    (tmp_path / "book.txt").write_text(content)
    monkeypatch.setattr(sources_module, "CHUNK_BYTES", 100)  # many pieces, each cut after a newline
    monkeypatch.setattr(token_file_module, "BATCH_PIECES", 3)  # many encode batches
    spec = wordlevel(tmp_path / "tok", [*WORDS, ".", "no", "newline", "at", "end"])
    data = prepare_data(cfg(tmp_path / "book.txt", tmp_path / "cache", tokenizer=spec), 8, tmp_path)
    tok = load_tokenizer(spec)
    whole = torch.cat([tok.encode(content), torch.tensor([tok.eos_token_id])])  # one document, ended by EOS
    train, val = data.file.reader("train")[:].long(), data.file.reader("val")[:].long()
    assert len(val) == round(len(whole) * 0.2) and torch.equal(torch.cat([train, val]), whole)
    assert (data.file.meta["train_documents"], data.file.meta["val_documents"]) == (1, 1)
    byte_data = prepare_data(cfg(tmp_path / "book.txt", tmp_path / "cache-bytes"), 8, tmp_path).file
    assert bytes(torch.cat([byte_data.reader("train")[:], byte_data.reader("val")[:]]).tolist()) == content.encode() + b"\0"


def test_fallback_split_with_a_multi_byte_dtype(tmp_path: Path) -> None:
    docs = texts(3)
    data_path = write_jsonl(tmp_path / "d.jsonl", docs)
    spec = wordlevel(tmp_path / "tok", [f"w{i}" for i in range(300)] + [*WORDS, "."])  # uint16
    data = prepare_data(DataConfig(path=str(data_path), val_fraction=0.99, cache=str(tmp_path / "c"), tokenizer=spec),
                        2, tmp_path)
    assert all(token_file_module.in_val(f"line {i}", 0.99) for i in (1, 2, 3))  # so the fallback decides
    tok = load_tokenizer(spec)
    assert data.file.meta["dtype"] == "H"
    # round(3 · 0.99) = 3 clipped to n - 1 = 2: the last two documents are val
    assert (data.file.meta["train_documents"], data.file.meta["val_documents"]) == (1, 2)
    eos = torch.tensor([tok.eos_token_id])
    assert torch.equal(data.file.reader("train")[:].long(), torch.cat([tok.encode(docs[0]), eos]))
    assert torch.equal(data.file.reader("val")[:].long(), torch.cat([tok.encode(docs[1]), eos, tok.encode(docs[2]), eos]))
    assert data.file.split("val").docs[:].tolist() == [0, len(tok.encode(docs[1])) + 1]


def test_resume_reads_the_same_windows_after_reopening(tmp_path: Path) -> None:
    data_path = write_jsonl(tmp_path / "d.jsonl", texts(200))
    config = cfg(data_path, tmp_path / "cache")
    first = prepare_data(config, 16, tmp_path)
    samplers = [DistributedSampler(len(first.train), 2, rank, seed=7) for rank in range(2)]
    for sampler in samplers:
        for _, _ in zip(range(25), sampler):  # consume 25 windows per rank
            pass
    states = [s.state_dict() for s in samplers]
    before = [[first.train[i] for _, i in zip(range(10), s)] for s in samplers]
    del first
    reopened = prepare_data(config, 16, tmp_path)  # a restarted worker: maps the same file again
    assert not reopened.file.built
    for rank, state in enumerate(states):
        sampler = DistributedSampler(len(reopened.train), 2, rank, seed=7)
        sampler.load_state_dict(state)
        after = [reopened.train[i] for _, i in zip(range(10), sampler)]
        assert all(all(map(torch.equal, a, b)) for a, b in zip(before[rank], after))


# ---- memory --------------------------------------------------------------------------------
def _memory_kib() -> dict[str, int]:
    """Rss / Pss / Anonymous of this process, and the Rss of any train.bin mapping (none expected), in KiB."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":")
        fields[key] = int(value.split()[0])
    mapped, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split()[0]:
            inside = line.rstrip().endswith("train.bin")
        elif inside and line.startswith("Rss:"):
            mapped += int(line.split()[1])
    return {"rss": fields["Rss"], "pss": fields["Pss"], "anonymous": fields["Anonymous"], "token_file_rss": mapped}


def _read_windows(cache: str, data_path: str, steps: int, global_batch: int, seq_len: int) -> dict[str, object]:
    """What a trainer rank does for data: open the token file, draw the epoch order, read its windows."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start = _memory_kib()
    data = prepare_data(DataConfig(path=data_path, val_fraction=0.001, cache=cache), seq_len, cache)
    order = DistributedSampler(len(data.train), world, rank, seed=0).epoch_indices(0)
    ordered = _memory_kib()
    checksum = 0
    per_rank = global_batch // world
    for step in range(steps):
        x, y, positions = zip(*(data.train[i] for i in order[step * per_rank : (step + 1) * per_rank]))
        checksum += int(torch.stack(x).sum()) + int(torch.stack(y).sum()) + int(torch.stack(positions).sum())
    return {"start": start, "ordered": ordered, "after": _memory_kib(), "windows": len(data.train),
            "checksum": checksum, "built": data.file.built}


@pytest.mark.slow
def test_resident_memory_for_data_stays_small_on_a_500_mb_corpus(tmp_path: Path) -> None:
    """≥ 500 MB of text → token file built once (the launcher's step) → 2 ranks open it, draw the
    epoch order and read 200 steps of 64 windows of 257 tokens; each rank's resident growth < 50 MB."""
    data_path = tmp_path / "big.txt"
    line = ("the quick brown fox jumps over the lazy dog " * 3 + "\n").encode()
    block = b"".join(f"{i} ".encode() + line for i in range(10_000))
    cache = tmp_path / "cache"
    try:
        with open(data_path, "wb") as f:
            while f.tell() < 520 * 2**20:
                f.write(block)
        config = DataConfig(path=str(data_path), val_fraction=0.001, cache=str(cache))
        built = prepare_data(config, 256, cache, verify=True)
        assert built.file.built and built.file.meta["train_tokens"] > 500 * 2**20
        del built
        results = run_distributed(_read_windows, 2, str(cache), str(data_path), 200, 64, 256, timeout=600)
    finally:  # 1 GB on disk: gone even when the test fails
        data_path.unlink(missing_ok=True)
        shutil.rmtree(cache, ignore_errors=True)
    report = []
    for rank, result in enumerate(results):
        assert not result["built"]
        grown = {key: (result["after"][key] - result["start"][key]) / 1024 for key in result["after"]}
        order = (result["ordered"]["rss"] - result["start"]["rss"]) / 1024
        report.append(f"rank {rank}: " + ", ".join(f"{k} +{v:.1f} MiB" for k, v in grown.items())
                      + f" (of which opening + the epoch order of {result['windows'] // 2:,} windows: +{order:.1f} MiB)")
        assert grown["rss"] < 50 and result["after"]["token_file_rss"] == 0, report[-1]
    print("\n".join(report))
