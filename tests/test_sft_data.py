"""Fine-tuning data (issue 34 items 1-2): EOS after every document, document starts and loss masks in the
token file, chat / instruction / completion records rendered with the tokenizer's chat template (or the
ChatML fallback), samples (x, y, positions) with -100 on non-targets, packed or padded, length limits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ndtrain.config import DataConfig
from ndtrain.data import prepare_data
from ndtrain.data.corpus import IGNORE, TokenWindows
from ndtrain.data.identity import fingerprint, identity_digest
from ndtrain.data.sft import Rendering, encode_examples
from ndtrain.data.sources import open_source
from ndtrain.data.tokenizer import ByteTokenizer, load_tokenizer
from ndtrain.errors import UserError
from ndtrain.trainer import stack
from tests.helpers.chat_task import save_chat_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["[UNK]", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = ("system user assistant be brief hi there how are you fine thanks and bye see later name the fox dog "
         "translate to french le chien a b c d e f g h").split()
# ChatML whose assistant turns are {% generation %} blocks, so transformers' own assistant mask exists to compare with
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
            "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CHAT = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
     {"role": "assistant", "content": "hi"}, {"role": "user", "content": "how are you"},
     {"role": "assistant", "content": "fine thanks and you"}],
    [{"role": "user", "content": "name the fox"}, {"role": "assistant", "content": "the fox"}],
    [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you later"}],
    [{"role": "user", "content": "translate the dog to french"}, {"role": "assistant", "content": "le chien"}],
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A WordLevel tokenizer folder with "</s>" as EOS and the ChatML template above (no download)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    save_chat_tokenizer(folder, SPECIALS, WORDS, "</s>", TEMPLATE)
    return f"hf:{folder}"


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def examples(path: Path, spec: str, rendering: Rendering) -> list[tuple[list[int], list[int]]]:
    """Each record's (ids, mask) as the token file receives them."""
    tokenizer = load_tokenizer(spec)
    code = "B" if tokenizer.vocab_size <= 256 else "H"
    return [(torch.frombuffer(bytearray(ids), dtype=torch.uint8 if code == "B" else torch.uint16).tolist(), list(mask))
            for _, ids, mask in encode_examples(open_source(str(path)), tokenizer, rendering)]


def data_cfg(path: Path, cache: Path, **kw: object) -> DataConfig:
    return DataConfig(path=str(path), val_fraction=0.25, cache=str(cache), **kw)  # type: ignore[arg-type]


def documents(data, split: str) -> list[tuple[list[int], list[int] | None]]:  # type: ignore[no-untyped-def]
    """A split's documents as (tokens, mask) read back from the token file."""
    parts = data.file.split(split)
    starts = parts.docs[:].tolist() + [len(parts.tokens)]
    tokens = parts.tokens[:].tolist()
    mask = parts.mask[:].tolist() if parts.mask is not None else None
    return [(tokens[a:b], mask[a:b] if mask is not None else None) for a, b in zip(starts, starts[1:])]


# ---- rendering ----------------------------------------------------------------------------------
def test_chat_tokens_and_assistant_mask_equal_apply_chat_template(tmp_path: Path, chat_tokenizer: str) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHAT])
    fast = transformers.AutoTokenizer.from_pretrained(chat_tokenizer[3:], local_files_only=True)
    got = examples(path, chat_tokenizer, Rendering("chat", "assistant"))
    for messages, (ids, mask) in zip(CHAT, got):
        want = fast.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(want["input_ids"]) and mask == list(want["assistant_masks"])
        assert 0 < sum(mask) < len(mask)
    first_ids, first_mask = got[0]
    trained = [fast.convert_ids_to_tokens(i) for i, m in zip(first_ids, first_mask) if m]
    assert trained == ["hi", "<|im_end|>", "fine", "thanks", "and", "you", "<|im_end|>"]  # no role header, no user turn
    # completion: only the final assistant turn; all: every token
    ids, mask = examples(path, chat_tokenizer, Rendering("chat", "completion"))[0]
    assert [fast.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m] == ["fine", "thanks", "and", "you", "<|im_end|>"]
    assert examples(path, chat_tokenizer, Rendering("chat", "all"))[0] == (first_ids, [1] * len(first_ids))


def test_every_record_format_renders_like_the_same_openai_messages(tmp_path: Path, chat_tokenizer: str) -> None:
    openai = [{"messages": m} for m in CHAT]
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"conversations": [{"from": names[t["role"]], "value": t["content"]} for t in m]} for m in CHAT]
    pairs = [(m[-2]["content"], m[-1]["content"]) for m in CHAT[1:]]
    alpaca = [{"instruction": "translate", "input": p, "output": c} for p, c in pairs]
    completion = [{"prompt": p, "completion": c} for p, c in pairs]
    as_chat = [{"messages": [{"role": "user", "content": f"translate\n\n{p}"}, {"role": "assistant", "content": c}]}
               for p, c in pairs]
    as_pairs = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]} for p, c in pairs]
    reference = {name: examples(write_jsonl(tmp_path / f"{name}.jsonl", records), chat_tokenizer, Rendering("chat", "assistant"))
                 for name, records in (("openai", openai), ("as_chat", as_chat), ("as_pairs", as_pairs))}
    cases = [("sharegpt", sharegpt, "chat", "openai"), ("alpaca", alpaca, "instruction", "as_chat"),
             ("completion", completion, "completion", "as_pairs"), ("openai", openai, "chat", "openai")]
    for name, records, kind, same in cases:
        for writer, suffix in ((write_jsonl, "jsonl"), (write_parquet, "parquet")):
            path = writer(tmp_path / f"{name}-x.{suffix}", records)
            assert examples(path, chat_tokenizer, Rendering(kind, "assistant")) == reference[same], (name, suffix)
            # data.kind = auto finds the kind from the first record's keys
            data = prepare_data(data_cfg(path, tmp_path / f"c-{name}-{suffix}", packing=False), 64, tmp_path)
            assert data.file.meta["identity"]["rendering"]["kind"] == kind


def test_without_a_chat_template_chatml_text_and_plain_concatenation(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])
    ids, mask = examples(path, "bytes", Rendering("chat", "assistant"))[0]
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert bytes(ids) == text.encode()
    assert bytes(i for i, m in zip(ids, mask) if m) == b"yo<|im_end|>\n"
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "add", "input": "1 2", "output": "3"},
                                              {"instruction": "say hi", "output": "hi"}])
    (ids, mask), (ids2, mask2) = examples(path, "bytes", Rendering("instruction", "completion"))
    assert bytes(ids) == b"add\n\n1 2\n\n3" and mask == [0] * 10 + [1]
    assert bytes(ids2) == b"say hi\n\nhi" and bytes(i for i, m in zip(ids2, mask2) if m) == b"hi"
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q: 1+1\nA:", "completion": " 2"}])
    ids, mask = examples(path, "bytes", Rendering("completion", "assistant"))[0]
    assert bytes(ids) == b"Q: 1+1\nA: 2" and mask == [0] * 9 + [1, 1]


# ---- token file -----------------------------------------------------------------------------------
def test_token_file_ends_documents_with_eos_and_stores_starts_and_mask(tmp_path: Path, chat_tokenizer: str) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHAT * 3])
    data = prepare_data(data_cfg(path, tmp_path / "cache"), 400, tmp_path)  # the byte tokenizer: ChatML text
    eos = ByteTokenizer.eos_token_id
    rendered = examples(path, "bytes", Rendering("chat", "assistant"))
    got = documents(data, "train") + documents(data, "val")
    assert len(got) == len(CHAT) * 3 == data.file.meta["train_documents"] + data.file.meta["val_documents"]
    assert sorted(got) == sorted((ids + [eos], mask + [mask[-1]]) for ids, mask in rendered)  # EOS a target after one
    assert all(tokens.count(eos) == 1 and tokens[-1] == eos for tokens, _ in got)
    names = {p.name for p in (tmp_path / "cache").iterdir()}
    assert names == {"train.bin", "train.docs", "train.mask", "val.bin", "val.docs", "val.mask", "meta.json"}
    assert set(data.file.meta["sha256"]) == names - {"meta.json"}
    # a damaged mask is found by the launcher's verification and rebuilt
    raw = bytearray((tmp_path / "cache" / "train.mask").read_bytes())
    raw[0] ^= 1
    (tmp_path / "cache" / "train.mask").write_bytes(bytes(raw))
    assert prepare_data(data_cfg(path, tmp_path / "cache"), 400, tmp_path, verify=True).file.built
    # plain text in the same cache: the masks go, EOS count = document count
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": f"doc {i}"} for i in range(12)])
    plain = prepare_data(data_cfg(text, tmp_path / "cache"), 4, tmp_path)
    assert not list((tmp_path / "cache").glob("*.mask")) and plain.file.split("train").mask is None
    tokens = plain.file.reader("train")[:].tolist() + plain.file.reader("val")[:].tolist()
    assert tokens.count(eos) == 12 == plain.file.meta["train_documents"] + plain.file.meta["val_documents"]


def test_tokenizer_without_eos_is_refused(tmp_path: Path) -> None:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tok.json"))
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "a a"}] * 4)
    with pytest.raises(UserError, match=r"names no end-of-sequence token.*eos_token=") as e:
        prepare_data(data_cfg(path, tmp_path / "c", tokenizer=f"hf:{tmp_path / 'tok.json'}"), 2, tmp_path)
    assert "\n" not in str(e.value) and not (tmp_path / "c").exists()


def test_overlong_examples_are_truncated_or_dropped_and_counted(tmp_path: Path) -> None:
    records = [{"prompt": "p", "completion": "c" * n} for n in (2, 3, 20, 30, 4, 40)]  # documents of n + 2 tokens
    path = write_jsonl(tmp_path / "p.jsonl", records)
    cut = prepare_data(data_cfg(path, tmp_path / "cut", max_length=10, packing=False), 16, tmp_path)
    assert "6 examples: 3 truncated to 10 tokens" in cut.description
    docs = documents(cut, "train") + documents(cut, "val")
    assert sorted(len(t) for t, _ in docs) == [4, 5, 6, 10, 10, 10]
    assert sum(t[-1] == 0 for t, _ in docs) == 3  # a truncated example has no EOS
    dropped = prepare_data(data_cfg(path, tmp_path / "drop", max_length=10, overlong="drop", packing=False), 16, tmp_path)
    assert "6 examples: 3 dropped as longer than 10 tokens" in dropped.description
    assert sorted(len(t) for t, _ in documents(dropped, "train") + documents(dropped, "val")) == [4, 5, 6]
    # the default limit is one sample: model.seq_len + 1 tokens; a longer one is refused
    assert "1 truncated to 33 tokens" in prepare_data(data_cfg(path, tmp_path / "d", packing=False), 32, tmp_path).description
    with pytest.raises(UserError, match="data.max_length=40 is longer than a sample of model.seq_len=16"):
        prepare_data(data_cfg(path, tmp_path / "e", max_length=40), 16, tmp_path)
    # truncation that leaves no target: the example is dropped and counted
    long_prompt = write_jsonl(tmp_path / "l.jsonl", [{"prompt": "p" * 20, "completion": "c"}] + records[:3])
    left = prepare_data(data_cfg(long_prompt, tmp_path / "l", max_length=10, packing=False), 16, tmp_path)
    assert "1 dropped without a target token" in left.description


# ---- samples ------------------------------------------------------------------------------------
def test_packed_windows_restart_positions_and_ignore_the_boundary_target(tmp_path: Path) -> None:
    # documents of 5, 8 and 4 tokens (each ended by EOS = 0), packed: 17 tokens
    data = torch.tensor([1, 2, 3, 4, 0, 5, 6, 7, 8, 9, 10, 11, 0, 12, 13, 14, 0], dtype=torch.uint8)
    windows = TokenWindows(data, 6, docs=torch.tensor([0, 5, 13]))
    assert len(windows) == 2
    x, y, positions = windows[0]
    assert x.tolist() == [1, 2, 3, 4, 0, 5]
    assert y.tolist() == [2, 3, 4, 0, IGNORE, 6]  # EOS → the next document's first token is no target
    assert positions.tolist() == [0, 1, 2, 3, 4, 0]
    x, y, positions = windows[1]  # starts inside the second document: positions count from the window's start
    assert x.tolist() == [6, 7, 8, 9, 10, 11] and y.tolist() == [7, 8, 9, 10, 11, 0]
    assert positions.tolist() == [0, 1, 2, 3, 4, 5]
    x, y, positions = TokenWindows(data, 8, docs=torch.tensor([0, 5, 13]))[1]
    assert x.tolist() == [8, 9, 10, 11, 0, 12, 13, 14] and y.tolist() == [9, 10, 11, 0, IGNORE, 13, 14, 0]
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]


def test_a_packed_documents_targets_are_its_own(tmp_path: Path) -> None:
    """Every document's targets within packed windows are exactly the ones it has alone."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "x" * n} for n in (3, 11, 6, 17, 2, 9, 14, 5, 8, 12, 4, 10)])
    data = prepare_data(data_cfg(path, tmp_path / "c"), 7, tmp_path)
    tokens = data.file.reader("train")[:].long()
    packed = [t for i in range(len(data.train)) for t in data.train[i][1].tolist()]
    targets = tokens[1 : len(packed) + 1].tolist()
    starts = set(data.file.split("train").docs[:].tolist())
    assert packed == [IGNORE if i + 1 in starts else t for i, t in enumerate(targets)]
    for i in range(len(data.train)):  # positions: 0 at the window's start and at each document start, else + 1
        positions = data.train[i][2].tolist()
        restarts = [j == 0 or i * 7 + j in starts for j in range(7)]
        assert positions == [0 if r else positions[j - 1] + 1 for j, r in enumerate(restarts)]


def test_fine_tuning_examples_are_packed_whole(tmp_path: Path, chat_tokenizer: str) -> None:
    """Packed fine-tuning samples hold whole examples in file order, as many as fit in seq_len + 1 tokens,
    then EOS padding: no example is cut at a window's edge, each appears once, with its own targets."""
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHAT * 4])
    seq_len = 30
    data = prepare_data(data_cfg(path, tmp_path / "c", tokenizer=chat_tokenizer), seq_len, tmp_path)
    eos = load_tokenizer(chat_tokenizer).eos_token_id
    docs = documents(data, "train")
    seen = []
    for i in range(len(data.train)):
        x, y, positions = data.train[i]
        tokens = x.tolist() + [eos]
        starts = [j for j, p in enumerate(positions.tolist()) if p == 0]
        filled = sum(len(docs[len(seen) + k][0]) for k in range(len(starts)))
        for k, a in enumerate(starts):
            b = starts[k + 1] if k + 1 < len(starts) else filled
            doc_tokens, mask = docs[len(seen)]
            assert tokens[a:b] == doc_tokens and b - a == len(doc_tokens)
            want = [t if m else IGNORE for t, m in zip(doc_tokens[1:], mask[1:])] + [IGNORE]
            assert y.tolist()[a:b] == want  # its own targets; the one crossing into the next is none
            seen.append(len(doc_tokens))
        assert set(y.tolist()[filled:]) <= {IGNORE} and set(tokens[filled:]) <= {eos}
        if len(seen) < len(docs):  # the bin is full: the next example would not have fitted
            assert filled + len(docs[len(seen)][0]) > seq_len + 1
    assert seen == [len(t) for t, _ in docs]


def test_unpacked_examples_are_padded_and_masked(tmp_path: Path, chat_tokenizer: str) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHAT * 2])
    data = prepare_data(data_cfg(path, tmp_path / "c", tokenizer=chat_tokenizer, packing=False), 40, tmp_path)
    eos = load_tokenizer(chat_tokenizer).eos_token_id
    docs = documents(data, "train")
    assert len(data.train) == len(docs)
    for i, (tokens, mask) in enumerate(docs):
        x, y, positions = data.train[i]
        n = len(tokens)
        assert x.tolist() == (tokens + [eos] * 41)[:40]
        assert y.tolist() == ([t if m else IGNORE for t, m in zip(tokens[1:], mask[1:])] + [IGNORE] * 40)[:40]
        assert positions.tolist() == list(range(40)) and tokens[-1] == eos and n <= 41
    batch = stack([data.train[0], data.train[1]])
    assert [tuple(t.shape) for t in batch] == [(2, 40)] * 3


def test_loss_on_all_and_text_kinds(tmp_path: Path, chat_tokenizer: str) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHAT * 2])
    data = prepare_data(data_cfg(path, tmp_path / "c", tokenizer=chat_tokenizer, loss_on="all", packing=False), 40,
                        tmp_path)
    for i in range(len(data.train)):
        x, y, _ = data.train[i]
        real = int((x != load_tokenizer(chat_tokenizer).eos_token_id).sum())
        assert (y != IGNORE).sum() == real  # every token of the example but the first is a target, EOS included
    (tmp_path / "book.txt").write_text("hello")
    with pytest.raises(UserError, match=r"data.kind='chat' reads records, but data.path is a text file"):
        prepare_data(data_cfg(tmp_path / "book.txt", tmp_path / "b", kind="chat"), 8, tmp_path)


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user"}]}, r"line 2: messages\[0\] has no string \"content\""),
    ({"messages": "hi"}, r"line 2 has no list \"messages\""),
    ({"conversations": [{"from": "bot", "value": "x"}]}, r"line 2: conversations\[0\] has \"from\": \"bot\""),
    ({"instruction": "x"}, r"line 2 has no string \"output\" field"),
    ({"instruction": "x", "output": "y", "input": 3}, r"line 2 has an \"input\" that is not a string"),
    (["x"], r"line 2 is not an object"),
])
def test_bad_records_are_one_line_errors_naming_line_and_field(tmp_path: Path, record: object, message: str) -> None:
    kind = "instruction" if isinstance(record, dict) and "instruction" in record else "chat"
    good = {"messages": CHAT[1]} if kind == "chat" else {"instruction": "a", "output": "b"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, record])  # type: ignore[list-item]
    with pytest.raises(UserError, match=message) as e:
        prepare_data(data_cfg(path, tmp_path / "c"), 64, tmp_path)
    assert "\n" not in str(e.value) and "bad.jsonl" in str(e.value)


def test_fine_tuning_settings_are_part_of_the_data_identity(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}", "completion": "c" * (i % 12)} for i in range(40)])
    base = data_cfg(path, tmp_path / "c")
    digests = {identity_digest(base, 16)}
    for change in ({"loss_on": "all"}, {"packing": False}, {"max_length": 8}, {"overlong": "drop"}):
        digests.add(identity_digest(data_cfg(path, tmp_path / "c", **change), 16))
    assert len(digests) == 5
    packed = fingerprint(prepare_data(base, 16, tmp_path).file.meta)
    unpacked = fingerprint(prepare_data(data_cfg(path, tmp_path / "u", packing=False), 16, tmp_path).file.meta)
    assert packed["tokens"] != unpacked["tokens"]  # the same token files, other samples: a resume is refused
