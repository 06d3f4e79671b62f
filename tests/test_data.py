"""Tokenizer, corpus loading and splitting, token windows, and the distributed samplers."""

import json
import os
import zlib
from pathlib import Path

import pytest
import torch

from ndtrain.data import ByteTokenizer, DistributedSampler, TokenWindows, eval_shard, load_corpus
from ndtrain.data import sources as sources_module
from ndtrain.errors import UserError


def in_val(name: str, fraction: float) -> bool:
    return zlib.crc32(name.encode()) / 2**32 < fraction


def text(tensor: torch.Tensor) -> str:
    return ByteTokenizer().decode(tensor)


def ended(documents: list[str]) -> str:
    """Documents as a token file holds them: each followed by the byte tokenizer's EOS, NUL."""
    return "".join(f"{d}\0" for d in documents)


# ---- tokenizer ------------------------------------------------------------------------------
def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("naïve → ok")
    assert ids.dtype == torch.uint8 and ids.tolist() == list("naïve → ok".encode())
    assert tok.decode(ids) == "naïve → ok"
    assert tok.decode([104, 105]) == "hi"
    assert tok.decode([0xE2, 0x86]) == "\ufffd"  # a character cut in half
    assert tok.encode("").shape == (0,)


# ---- sources --------------------------------------------------------------------------------
def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))


def test_jsonl_split_follows_crc_of_line_names(tmp_path: Path) -> None:
    texts = [f"document {i}" for i in range(60)]
    write_jsonl(tmp_path / "d.jsonl", texts)
    corpus = load_corpus(str(tmp_path / "d.jsonl"), 0.3)
    val = [t for i, t in enumerate(texts) if in_val(f"line {i + 1}", 0.3)]
    train = [t for i, t in enumerate(texts) if not in_val(f"line {i + 1}", 0.3)]
    assert 0 < len(val) < 60  # the rule itself decided, not the fallback
    assert text(corpus.val) == ended(val)
    assert text(corpus.train) == ended(train)
    assert (corpus.train_documents, corpus.val_documents) == (len(train), len(val))
    assert corpus.train.dtype == torch.uint8 and corpus.train.ndim == 1


def test_jsonl_skips_blank_lines_and_keeps_line_numbers(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n\n{"text": "b"}\n')
    corpus = load_corpus(str(tmp_path / "d.jsonl"), 0.5)
    assert corpus.train_documents + corpus.val_documents == 2
    assert sorted(text(corpus.train) + text(corpus.val)) == ["\0", "\0", "a", "b"]


@pytest.mark.parametrize(
    "bad_line, message",
    [("{not json", "line 3 is not valid"), ('{"txt": "x"}', "line 3 has no string"), ('{"text": 5}', "line 3 has no"),
     ('["text"]', "line 3 has no")],
)
def test_bad_jsonl_line_names_its_number(tmp_path: Path, bad_line: str, message: str) -> None:
    (tmp_path / "d.jsonl").write_text(f'{{"text": "a"}}\n{{"text": "b"}}\n{bad_line}\n{{"text": "c"}}\n')
    with pytest.raises(UserError, match=message):
        load_corpus(str(tmp_path / "d.jsonl"), 0.1)


def make_folder(root: Path, count: int) -> dict[str, str]:
    files = {f"sub{i % 3}/file{i}.txt": f"content of file {i}" for i in range(count)}
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    return files


def test_folder_documents_hidden_and_binary_files(tmp_path: Path) -> None:
    files = make_folder(tmp_path, 40)
    (tmp_path / ".hidden.txt").write_text("HIDDEN")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("HIDDEN")
    (tmp_path / "sub0" / "blob.bin").write_bytes(b"\xff\xfe\x00bad")
    corpus = load_corpus(str(tmp_path), 0.25)
    val = [files[n] for n in sorted(files) if in_val(n, 0.25)]
    train = [files[n] for n in sorted(files) if not in_val(n, 0.25)]
    assert 0 < len(val) < len(files)
    assert text(corpus.val) == ended(val)
    assert text(corpus.train) == ended(train)
    assert "HIDDEN" not in text(corpus.train) + text(corpus.val)
    assert "40 files, 1 skipped" in corpus.description


def test_split_is_independent_of_listing_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_folder(tmp_path, 30)
    first = load_corpus(str(tmp_path), 0.2)
    real_walk = os.walk

    def reversed_walk(top: str | os.PathLike[str]):  # type: ignore[no-untyped-def]
        for folder, dirs, files in real_walk(top):
            dirs.reverse()  # in place, so the loader's pruning still applies
            yield folder, dirs, files[::-1]

    monkeypatch.setattr(sources_module.os, "walk", reversed_walk)
    second = load_corpus(str(tmp_path), 0.2)
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)


def test_fallback_puts_last_document_in_val(tmp_path: Path) -> None:
    names = [n for n in (f"doc{i}.txt" for i in range(100)) if not in_val(n, 0.01)][:3]
    assert len(names) == 3
    for name in names:
        (tmp_path / name).write_text(name.upper())
    corpus = load_corpus(str(tmp_path), 0.01)  # no name hashes below 0.01: val would be empty
    assert text(corpus.val) == ended([sorted(names)[-1].upper()])
    assert (corpus.train_documents, corpus.val_documents) == (2, 1)


def test_fallback_keeps_train_non_empty(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", ["x", "y"])
    assert all(in_val(f"line {i}", 0.99) for i in (1, 2))
    corpus = load_corpus(str(tmp_path / "d.jsonl"), 0.99)
    assert (text(corpus.train), text(corpus.val)) == ("x\0", "y\0")


def test_single_text_file_splits_by_position(tmp_path: Path) -> None:
    content = "".join(f"line {i}: é\n" for i in range(100))
    (tmp_path / "book.txt").write_text(content)
    corpus = load_corpus(str(tmp_path / "book.txt"), 0.1)
    data = content.encode() + b"\0"  # one document, ended by EOS, cut by position
    assert len(corpus.val) == round(len(data) * 0.1)
    assert bytes(corpus.train.tolist()) + bytes(corpus.val.tolist()) == data
    assert (corpus.train_documents, corpus.val_documents) == (1, 1)


def test_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_corpus(str(tmp_path / "missing"), 0.1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no text"):
        load_corpus(str(tmp_path / "empty"), 0.1)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="holds no text"):
        load_corpus(str(tmp_path / "empty.jsonl"), 0.1)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        load_corpus(str(tmp_path / "latin1.txt"), 0.1)
    (tmp_path / "ok.txt").write_text("hello")
    with pytest.raises(UserError, match="val_fraction"):
        load_corpus(str(tmp_path / "ok.txt"), 1.0)


def test_default_stdlib_corpus() -> None:
    corpus = load_corpus(None, 0.02)
    assert len(corpus.train) > 1_000_000 and len(corpus.val) > 0
    assert corpus.train_documents > 100 and corpus.val_documents > 0
    assert "def " in text(corpus.train[:200_000]) and "standard library" in corpus.description


# ---- windows --------------------------------------------------------------------------------
def test_token_windows() -> None:
    data = torch.arange(23, dtype=torch.uint8)
    windows = TokenWindows(data, 5)
    assert len(windows) == 4  # (23 - 1) // 5
    x, y, positions = windows[3]
    assert x.dtype == y.dtype == positions.dtype == torch.int64
    assert x.tolist() == [15, 16, 17, 18, 19] and y.tolist() == [16, 17, 18, 19, 20]
    assert positions.tolist() == [0, 1, 2, 3, 4]  # inside one document: counted from the window's start
    assert windows[0][0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        windows[4]
    assert len(TokenWindows(torch.zeros(6, dtype=torch.uint8), 5)) == 1
    with pytest.raises(UserError, match="the val has 5 bytes.*at least 6 bytes"):
        TokenWindows(torch.zeros(5, dtype=torch.uint8), 5, name="val")


# ---- samplers -------------------------------------------------------------------------------
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_sampler_ranks_are_disjoint_and_cover_the_epoch(replicas: int) -> None:
    n = 103
    samplers = [DistributedSampler(n, replicas, r, seed=5) for r in range(replicas)]
    per_rank = [list(s) for s in samplers]
    assert all(len(p) == len(s) == n // replicas for p, s in zip(per_rank, samplers))
    merged = [i for p in per_rank for i in p]
    assert len(set(merged)) == len(merged) == (n // replicas) * replicas
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
    interleaved = [per_rank[k % replicas][k // replicas] for k in range(len(merged))]
    assert interleaved == order[: len(merged)]


def test_sampler_epochs() -> None:
    sampler = DistributedSampler(50, 2, 1, seed=3)
    first = list(sampler)
    assert list(sampler) == first == sampler.epoch_indices(0)  # same epoch, same order
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first  # a new order ...

    def everyone(epoch: int) -> list[int]:
        return sorted(i for r in range(2) for i in DistributedSampler(50, 2, r, seed=3).epoch_indices(epoch))

    assert everyone(0) == everyone(1) == list(range(50))  # ... of the same samples
    assert DistributedSampler(50, 2, 1, seed=4).epoch_indices(0) != first
    assert list(DistributedSampler(10, 3, 2, shuffle=False)) == [2, 5, 8]


def test_sampler_resumes_mid_epoch() -> None:
    sampler = DistributedSampler(40, 3, 1, seed=9)
    sampler.set_epoch(2)
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(5)]
    state = sampler.state_dict()
    assert state == {"epoch": 2, "consumed": 5}
    resumed = DistributedSampler(40, 3, 1, seed=9)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # a trainer re-announcing the epoch keeps the position
    assert head + list(resumed) == sampler.epoch_indices(2)
    assert len(list(resumed)) == len(resumed)  # a finished epoch replays from its start
    with pytest.raises(UserError, match="consumed=99"):
        resumed.load_state_dict({"epoch": 0, "consumed": 99})


@pytest.mark.parametrize("n, replicas", [(10, 3), (7, 4), (2, 3), (0, 2), (12, 4)])
def test_eval_shard_covers_each_sample_once(n: int, replicas: int) -> None:
    shards = [eval_shard(n, replicas, r) for r in range(replicas)]
    assert [i for s in shards for i in s] == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
