"""`ndtrain generate` (ndtrain/generate.py): the KV-cache path (the HF model's own `generate`) gives the
full-window sampler's greedy tokens, for the built-in Llama (converted in memory) and an HF Llama; both stop at
the first end-of-sequence token; `--chat` renders the run tokenizer's chat template and prints the reply
only, and is refused in one line (exit status 2) for a tokenizer without a template."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ndtrain.config import ModelConfig
from ndtrain.data.sft import CHATML_END, chatml_prompt_ids
from ndtrain.data.tokenizer import byte_level_tokenizer, load_tokenizer
from ndtrain.generate import cached_generate, generate_text, sample
from ndtrain.models.llama import build_model
from tests.helpers.runs import corpus_file, ndtrain, tiny_config, train

transformers = pytest.importorskip("transformers")

SEQ = 24
PROMPT = torch.tensor([3, 17, 200, 5, 99])
NEW = SEQ - len(PROMPT)  # the whole first window: both paths see every token
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")

pytestmark = pytest.mark.usefixtures("one_thread")


def builtin() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny built-in Llama with spread-out logits (init_std 0.2) and its in-memory LlamaForCausalLM."""
    from ndtrain.models.llama_hf import builtin_to_hf

    cfg = ModelConfig(preset="tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=SEQ,
                      init_std=0.2)
    model = build_model(cfg, seed=0).eval()
    return model, builtin_to_hf(model, cfg)


def hf_llama() -> tuple[torch.nn.Module, torch.nn.Module]:
    from tests.helpers.hf import make_model

    model = make_model("llama").float().eval()
    return model, model.hf


MODELS = {"builtin": builtin, "hf-llama": hf_llama}


def greedy_window(model: torch.nn.Module, eos: set[int] = set()) -> torch.Tensor:
    return sample(model, PROMPT, NEW, SEQ, 0.0, 0, torch.Generator().manual_seed(0), eos)


@pytest.mark.parametrize("name", list(MODELS))
def test_kv_cache_greedy_equals_the_full_window_sampler(name: str) -> None:
    model, hf = MODELS[name]()
    reference = greedy_window(model)
    assert len(reference) == SEQ and len(set(reference[len(PROMPT):].tolist())) > 1  # not one token repeated
    assert cached_generate(hf, PROMPT, NEW, SEQ, 0.0, 0, 0).tolist() == reference.tolist()
    longer = cached_generate(hf, PROMPT, 3 * SEQ, SEQ, 0.0, 0, 0)  # past the window: restarts from its half
    assert len(longer) == len(PROMPT) + 3 * SEQ and longer[:SEQ].tolist() == reference.tolist()


@pytest.mark.parametrize("name", list(MODELS))
def test_generation_stops_at_the_first_eos(name: str) -> None:
    model, hf = MODELS[name]()
    free = greedy_window(model)[len(PROMPT):].tolist()
    eos = free[len(free) // 2]  # a token the greedy model emits mid-way
    first = free.index(eos)
    expected = PROMPT.tolist() + free[: first + 1]
    assert greedy_window(model, {eos}).tolist() == expected
    assert cached_generate(hf, PROMPT, NEW, SEQ, 0.0, 0, 0, {eos}).tolist() == expected
    sampled = cached_generate(hf, PROMPT, 200, SEQ, 1.0, 0, 7, {eos})  # sampling stops there too
    assert eos not in sampled[len(PROMPT):-1].tolist() and (len(sampled) == len(PROMPT) + 200 or sampled[-1] == eos)


def chat_tokenizer(folder: Path, template: str | None) -> Path:
    """A transformers tokenizer folder: ndtrain's byte-level BPE (ids = bytes), EOS the newline byte."""
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), eos_token="Ċ")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two-step tiny runs: one with a chat-template tokenizer, one with a transformers tokenizer without one."""
    root = tmp_path_factory.mktemp("generate")
    data = corpus_file(root)
    out = {}
    for name, template in (("chat", TEMPLATE), ("plain", None)):
        tokenizer = chat_tokenizer(root / f"tok-{name}", template)
        cfg = tiny_config(data, str(root / name), **{"schedule.steps": 2, "parallel.dp": 1,
                                                     "data.tokenizer": f"hf:{tokenizer}"})
        train(cfg)
        out[name] = root / name
    return out


def test_chat_renders_the_template_and_prints_the_reply(runs: dict[str, Path]) -> None:
    rendered = "<user>def f(x):<assistant>"
    plain = generate_text(runs["chat"], rendered, 12, 0.0, 0, 0)
    reply = generate_text(runs["chat"], "def f(x):", 12, 0.0, 0, 0, chat=True)
    assert plain == rendered + reply and "\n" not in reply  # the newline is EOS: generation ends before it


def test_chat_without_a_template_renders_the_chatml_its_chat_records_were_trained_on(runs: dict[str, Path]) -> None:
    """No chat template: the prompt is rendered as training renders chat records (data/sft.py's ChatML, each
    part encoded alone) and the reply ends at its first <|im_end|>."""
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tokenizer = load_tokenizer(f"hf:{runs['plain'].parent / 'tok-plain'}")
    assert chatml_prompt_ids(tokenizer, "hi").tolist() == tokenizer.encode(rendered).tolist()  # ids = bytes here
    plain = generate_text(runs["plain"], rendered, 40, 0.0, 0, 0)
    reply = generate_text(runs["plain"], "hi", 40, 0.0, 0, 0, chat=True)
    assert plain.startswith(rendered + reply) and CHATML_END not in reply
    assert plain == rendered + reply or plain[len(rendered) + len(reply):].startswith(CHATML_END)
    proc = ndtrain("generate", str(runs["plain"]), "--chat", "--prompt", "hi", "--max-new-tokens", "40",
                   "--temperature", "0")
    assert proc.returncode == 0 and proc.stdout.rstrip("\n") == reply
