"""A chat fine-tune through the command line with the README's fine-tuning commands (read from README.md:
`ndtrain train`, `ndtrain generate --chat`, `ndtrain export --format hf`, paths substituted) on a tiny
"pretrained" HF folder with its own tokenizer and chat template and a chat JSONL file
(tests/helpers/chat_task.py holds the task).

The assistant's reply is a deterministic function of the user's turn, the user's letters are random
(entropy log 8 nats each). With `data.loss_on = assistant` the validation loss on replies falls far
below that entropy and the greedy reply of the exported model is right on prompts it never saw; with
`data.loss_on = all` the user's letters are targets too, and their loss stays at their entropy: no
model can predict them, so the reported mean over all targets stays above (user letters / targets) · log 8.
"""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.chat_task import ALPHABET, LETTERS, USER_ENTROPY, pretrained_folder, prompt, reply, write_chats

transformers = pytest.importorskip("transformers")

CONVERSATIONS = 2000
HELD_OUT = 40
TINY = ["--nproc", "1", "--seq-len", "64", "--eval-every", "0"]

pytestmark = pytest.mark.slow


def ndtrain(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "ndtrain", *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("chat")
    model = pretrained_folder(root / "model")
    seen = set(write_chats(root / "chat.jsonl", CONVERSATIONS, seed=1))
    rng = random.Random(2)
    held_out: list[str] = []
    while len(held_out) < HELD_OUT:
        if (p := prompt(rng)) not in seen and p not in held_out:
            held_out.append(p)
    return {"root": root, "model": model, "data": root / "chat.jsonl", "held_out": held_out}


def readme_commands() -> list[list[str]]:
    """The three commands of the README's fine-tuning section (its first bash block)."""
    section = (Path(__file__).parents[1] / "README.md").read_text().split("## Fine-tuning a pretrained model", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.startswith("ndtrain ")]


def fine_tune(task: dict[str, Any], loss_on: str) -> tuple[dict[str, Any], Path]:
    """The README's train and export commands on the task's folder and file (its paths substituted, the
    tiny run's --nproc, --seq-len and --eval-every added, and `data.loss_on`)."""
    run, exported = task["root"] / f"run-{loss_on}", task["root"] / f"export-{loss_on}"
    paths = {"hf:path/to/model": f"hf:{task['model']}", "chat.jsonl": str(task["data"]), "runs/chat": str(run),
             "chat-model": str(exported)}
    train, _, export = readme_commands()
    ndtrain(*[paths.get(a, a) for a in train[1:]], *TINY, "--set", f"data.loss_on={loss_on}")
    ndtrain(*[paths.get(a, a) for a in export[1:]])
    return json.loads((run / "summary.json").read_text()), exported


def role_losses(folder: Path, prompts: list[str]) -> tuple[float, float]:
    """Mean loss per user letter and per reply letter of the exported model on whole conversations."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    user, answer = [], []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": reply(p)}],
                                            tokenize=True, return_dict=False)
        ids = torch.tensor([ids])
        with torch.no_grad():
            nll = F.cross_entropy(model(ids, use_cache=False).logits[0, :-1], ids[0, 1:], reduction="none")
        letters = [i for i, t in enumerate(ids[0, 1:].tolist()) if tokenizer.convert_ids_to_tokens(t) in ALPHABET]
        user += nll[letters[:LETTERS]].tolist()
        answer += nll[letters[LETTERS:]].tolist()
    return sum(user) / len(user), sum(answer) / len(answer)


def greedy_replies(folder: Path, prompts: list[str]) -> list[str]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    out = []
    for p in prompts:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        tokens = model.generate(**inputs, max_new_tokens=2 * LETTERS, do_sample=False)
        out.append(tokenizer.decode(tokens[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return out


def test_loss_on_assistant_learns_the_replies(task: dict[str, Any]) -> None:
    summary, exported = fine_tune(task, "assistant")
    assert summary["val_loss"] < USER_ENTROPY / 10, summary["val_loss"]
    answers = greedy_replies(exported, task["held_out"])
    right = sum(a == reply(p) for a, p in zip(answers, task["held_out"]))
    assert right == len(task["held_out"]), list(zip(task["held_out"], answers))
    p = task["held_out"][0]
    generate = readme_commands()[1]  # the README's generate command, on a held-out prompt
    at = generate.index("--prompt") + 1
    generate[at] = p
    printed = ndtrain(*[str(task["root"] / "run-assistant") if a == "runs/chat" else a for a in generate[1:]])
    assert printed.strip().splitlines()[-1].strip() == reply(p)  # stops at EOS: nothing after the reply
    _, answer_loss = role_losses(exported, task["held_out"])
    print(f"\nloss_on=assistant: val_loss {summary['val_loss']:.4f} nats/target (entropy of a user letter "
          f"{USER_ENTROPY:.4f}); reply-letter loss on held-out prompts {answer_loss:.4f}; greedy replies right "
          f"{right}/{len(task['held_out'])}")


def test_loss_on_all_stays_above_the_user_entropy(task: dict[str, Any]) -> None:
    summary, exported = fine_tune(task, "all")
    user_loss, answer_loss = role_losses(exported, task["held_out"])
    targets = 2 * LETTERS + 5  # per conversation: the letters, "user", "assistant", 2 turn starts, 2 ends, less the boundary
    share = LETTERS / targets
    assert user_loss > 0.95 * USER_ENTROPY, user_loss
    assert summary["val_loss"] > share * 0.95 * USER_ENTROPY, summary["val_loss"]
    print(f"\nloss_on=all: val_loss {summary['val_loss']:.4f} nats/target; user-letter loss on held-out prompts "
          f"{user_loss:.4f} (entropy {USER_ENTROPY:.4f}); reply-letter loss {answer_loss:.4f}")
