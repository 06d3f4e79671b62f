"""A chat task whose replies are learnable and whose prompts are not, with a tiny "pretrained" model.

The user turn is `LETTERS` random letters of an alphabet of 8, so its entropy is log 8 nats per letter
(`USER_ENTROPY`); the assistant's reply is the same letters each moved one place on (a→b, …, h→a): a
deterministic function of the user turn. A model trained on the replies can drive their loss to zero;
no model can predict the user's letters below log 8 per letter.

`pretrained_folder` writes what a user brings: a transformers Llama folder (config.json and seeded
random weights, as save_pretrained writes them) with its own tokenizer: a WordLevel vocabulary,
"<|im_end|>" as EOS (it ends every turn, so a reply's end is the end of generation) and a ChatML-like
chat template. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

ALPHABET = "abcdefgh"
LETTERS = 4
USER_ENTROPY = math.log(len(ALPHABET))  # nats per user letter
SPECIALS = ["[UNK]", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", *ALPHABET]
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def reply(prompt: str) -> str:
    """The assistant's answer to a user turn: every letter moved one place on."""
    return " ".join(ALPHABET[(ALPHABET.index(c) + 1) % len(ALPHABET)] for c in prompt.split())


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(ALPHABET) for _ in range(LETTERS))


def write_chats(path: Path, count: int, seed: int) -> list[str]:
    """`count` conversations (OpenAI messages) into a JSONL file; returns their prompts."""
    rng = random.Random(seed)
    prompts = [prompt(rng) for _ in range(count)]
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                     {"role": "assistant", "content": reply(p)}]}) + "\n"
                            for p in prompts))
    return prompts


def save_chat_tokenizer(folder: Path, specials: list[str], words: list[str], eos: str, template: str) -> dict[str, int]:
    """A WordLevel tokenizer (whitespace pre-tokenizer; `specials` first, the first one unknown) with `eos` and
    the chat `template`, saved into `folder` as save_pretrained writes it; returns its vocabulary."""
    import tokenizers
    import transformers

    vocab = {token: i for i, token in enumerate([*specials, *words])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token=specials[0])
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    return vocab


def pretrained_folder(folder: Path, seed: int = 0) -> Path:
    """A tiny Llama (hidden 64, 2 layers) with seeded weights and its tokenizer, saved like a pretrained model."""
    import torch
    import transformers

    vocab = save_chat_tokenizer(folder, SPECIALS, WORDS, "<|im_end|>", TEMPLATE)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      eos_token_id=vocab["<|im_end|>"], bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder
