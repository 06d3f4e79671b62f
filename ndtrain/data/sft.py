"""Fine-tuning records → token ids and a loss mask (1 = the token is a target), one example a record.

`data.kind` says what a record is (`auto`: the first record's keys decide, in this order: `messages`
or `conversations` → chat, `instruction` → instruction, `prompt` and `completion` → completion, else
text; a text file or folder is always text):
- chat: `messages`, a list of {"role", "content"} (OpenAI), or `conversations`, a list of {"from",
  "value"} (ShareGPT: from human → user, gpt → assistant, system → system; user/assistant accepted too);
- instruction (Alpaca): `instruction`, optional `input`, `output`;
- completion: `prompt`, `completion`.
The prompt of an instruction record is `instruction`, followed by "\n\n" + `input` when that is not
empty; its completion is `output`.

Rendering. With a chat template (an `hf:` tokenizer folder that has one) every record becomes messages
(an instruction or completion record: a user turn holding the prompt and an assistant turn holding the
completion), rendered by `apply_chat_template` and tokenized as it tokenizes (no special tokens
added), so the ids are exactly `apply_chat_template(messages, tokenize=True)`'s. An assistant turn's
tokens are found by rendering prefixes: turn i spans the characters from the end of messages[:i]
rendered with the generation prompt to the end of messages[:i+1] rendered without; a token is in it
when its first character is (so a turn's end marker is a target, its role header is not). A template
that renders a prefix differently from the start of the whole conversation is refused.
Without a chat template (the byte tokenizer, a tokenizer.json): chat messages are written as ChatML,
"<|im_start|>ROLE\n" + content + "<|im_end|>\n" per message, the assistant's target being its content
and "<|im_end|>\n"; an instruction record is prompt + "\n\n" + output, a completion record prompt +
completion (plain concatenation: the record holds its own separators). Each part is encoded alone.

`data.loss_on`: `all` (every token), `assistant` (the assistant turns' tokens; for instruction and
completion records the completion), `completion` (the completion; for chat only the final assistant
turn, none when the conversation does not end with one). Text data are always trained on every token.

Cost: one tokenizer call a record (a chat template: 2 renders more per assistant turn); nothing is kept
beyond the record in hand. A malformed record is one UserError naming its line and field.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ndtrain.data.sources import Source
from ndtrain.data.tokenizer import ByteTokenizer, HFTokenizer, token_format
from ndtrain.errors import UserError

if TYPE_CHECKING:
    from ndtrain.config import DataConfig

CHATML_END = "<|im_end|>"  # ends every message of the ChatML rendering (no chat template)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
CHAT_KEYS = {"messages": ("role", "content"), "conversations": ("from", "value")}
FIELDS = {"instruction": ("instruction", "output"), "completion": ("prompt", "completion")}

Message = dict[str, str]


@dataclass(frozen=True)
class Rendering:
    """How records become a token file's documents and its samples. The token file's identity holds it,
    and the data fingerprint (identity.py) its samples' part too, so another setting is other data."""

    kind: str = "text"               # text | chat | instruction | completion ("auto" resolved)
    loss_on: str = "all"             # all | assistant | completion ("all" for text)
    max_length: int | None = None    # the longest document kept, its EOS counted (None: no limit)
    overlong: str = "truncate"       # truncate | drop a document above max_length
    packing: bool = True             # samples: packed windows, or one padded document each (corpus.py)


def rendering(data: DataConfig, seq_len: int, source: Source) -> Rendering:
    """The rendering of `data` on `source`: `data.kind` (auto: detected from the first record), its
    `loss_on` (all for text) and length limit (none for packed text: its documents span windows)."""
    kind = detect_kind(source) if data.kind == "auto" else data.kind
    if kind != "text" and source.records is None:
        raise UserError(f"data.kind={kind!r} reads records, but data.path is a {source.kind}: give a .jsonl or "
                        ".parquet file or a saved dataset, or set data.kind=text")
    limit = data.length_limit(seq_len)
    if kind == "text" and data.packing:
        return Rendering()
    return Rendering(kind, "all" if kind == "text" else data.loss_on, limit, data.overlong, data.packing)


def detect_kind(source: Source) -> str:
    """The kind of the source's first record by its keys (text for a text file or folder)."""
    if source.records is None:
        return "text"
    first = next(iter(source.records(None)), (0, None))[1]
    keys = set(first) if isinstance(first, dict) else set()
    if keys & set(CHAT_KEYS):
        return "chat"
    if "instruction" in keys:
        return "instruction"
    return "completion" if {"prompt", "completion"} <= keys else "text"


def encode_examples(source: Source, tokenizer: ByteTokenizer | HFTokenizer,
                    rendering: Rendering) -> Iterator[tuple[str, bytes, bytes]]:
    """Each record as (document key, ids, mask): the key "N\\0line N" as token_file.py's text documents."""
    assert source.records is not None
    code = token_format(tokenizer.vocab_size)
    template = isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template is not None
    for number, record in source.records(None):
        where = f"{source.where} {number}"
        if not isinstance(record, dict):
            raise UserError(f"{where} is not an object: every record must be a JSON object of data.kind={rendering.kind!r}")
        if rendering.kind == "chat":
            parts = chat_messages(record, where)
        else:
            prompt, completion = prompt_completion(record, rendering.kind, where)
            parts = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        if template:
            assert isinstance(tokenizer, HFTokenizer)
            ids, mask = render_template(parts, tokenizer, rendering.loss_on, where)
        else:
            ids, mask = render_plain(parts, tokenizer, rendering, code)
        yield f"{number}\0line {number}", array(code, ids).tobytes(), bytes(mask)


def chat_messages(record: dict[str, Any], where: str) -> list[Message]:
    """A chat record's messages as [{"role", "content"}], OpenAI's or ShareGPT's."""
    key = next((k for k in CHAT_KEYS if k in record), "messages")
    role_key, content_key = CHAT_KEYS[key]
    turns = record.get(key)
    if not isinstance(turns, list) or not turns:
        raise UserError(f'{where} has no list "{key}": a chat record holds "messages": [{{"role": ..., "content": ...}}] '
                        f'or "conversations": [{{"from": ..., "value": ...}}]')
    messages = []
    for i, turn in enumerate(turns):
        role = turn.get(role_key) if isinstance(turn, dict) else None
        content = turn.get(content_key) if isinstance(turn, dict) else None
        for field, value in ((role_key, role), (content_key, content)):
            if not isinstance(value, str):
                raise UserError(f"{where}: {key}[{i}] has no string {json.dumps(field)}: fix or remove the record")
        if key == "conversations":
            if role not in SHAREGPT_ROLES:
                raise UserError(f'{where}: {key}[{i}] has "from": {json.dumps(role)}, not one of '
                                f"{', '.join(SHAREGPT_ROLES)}: fix or remove the record")
            role = SHAREGPT_ROLES[role]
        messages.append({"role": role, "content": content})
    return messages


def prompt_completion(record: dict[str, Any], kind: str, where: str) -> tuple[str, str]:
    """An instruction or completion record's prompt and completion (module docstring)."""
    for field in FIELDS[kind]:
        if not isinstance(record.get(field), str):
            raise UserError(f"{where} has no string {json.dumps(field)} field: a record of data.kind={kind!r} holds "
                            + " and ".join(json.dumps(f) for f in FIELDS[kind]))
    if kind == "completion":
        return record["prompt"], record["completion"]
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise UserError(f'{where} has an "input" that is not a string: give a string, or leave it out')
    return record["instruction"] + (f"\n\n{extra}" if extra else ""), record["output"]


def targets(messages: list[Message], loss_on: str) -> list[bool]:
    """Which messages are trained on under `loss_on` (all: every one, the caller masks nothing)."""
    assistant = [m["role"] == "assistant" for m in messages]
    if loss_on == "completion":
        return [a and i == len(messages) - 1 for i, a in enumerate(assistant)]
    return assistant if loss_on == "assistant" else [True] * len(messages)


def render_template(messages: list[Message], tokenizer: HFTokenizer, loss_on: str,
                    where: str) -> tuple[list[int], list[int]]:
    """The ids of the messages as the tokenizer's chat template renders them, and the mask of `loss_on`."""
    text = tokenizer.render_chat(messages, add_generation_prompt=False)
    ids, starts = tokenizer.encode_with_offsets(text)
    if loss_on == "all":
        return ids, [1] * len(ids)
    spans = []
    for i, chosen in enumerate(targets(messages, loss_on)):
        if not chosen:
            continue
        before = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        through = tokenizer.render_chat(messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise UserError(f"{where}: the chat template of data.tokenizer={tokenizer.spec!r} renders the conversation "
                            "up to a turn differently from the start of the whole one, so its assistant tokens cannot "
                            "be found: use a template that renders earlier turns the same, or data.loss_on=all")
        spans.append((len(before), len(through)))
    return ids, [int(any(a <= s < b for a, b in spans)) for s in starts]


def chatml_parts(messages: list[Message]) -> list[str]:
    """`messages` as ChatML text, in the parts that are encoded alone: per message its role header, then its
    content with the end marker (`CHATML_END`) and a newline."""
    return [text for m in messages for text in (f"<|im_start|>{m['role']}\n", f"{m['content']}{CHATML_END}\n")]


def chatml_prompt_ids(tokenizer: ByteTokenizer | HFTokenizer, prompt: str) -> torch.Tensor:
    """The ids a model trained on ChatML-rendered chat records (a tokenizer without a chat template) answers:
    `prompt` as one user message and the assistant's header, each part encoded alone as in training."""
    texts = chatml_parts([{"role": "user", "content": prompt}]) + ["<|im_start|>assistant\n"]
    return torch.cat([tokenizer.encode(text).to(torch.int64) for text in texts])


def render_plain(messages: list[Message], tokenizer: ByteTokenizer | HFTokenizer, rendering: Rendering,
                 code: str) -> tuple[list[int], list[int]]:
    """The ids and mask without a chat template (module docstring): ChatML text for chat records,
    prompt and completion concatenated for the others; each part encoded alone."""
    chosen = targets(messages, rendering.loss_on)
    if rendering.kind == "chat":
        flags = [flag for c in chosen for flag in (rendering.loss_on == "all", c)]  # each role header, then its body
        parts = list(zip(chatml_parts(messages), flags))
    else:
        separator = "\n\n" if rendering.kind == "instruction" else ""
        parts = [(messages[0]["content"] + separator, chosen[0]), (messages[1]["content"], chosen[1])]
    ids: list[int] = []
    mask: list[int] = []
    for (_, target), data in zip(parts, tokenizer.encode_batch([text for text, _ in parts])):
        part = array(code, data).tolist()
        ids += part
        mask += [int(target)] * len(part)
    return ids, mask
