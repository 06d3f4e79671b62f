"""ndtrain's fine-tuning loss and gradients equal TRL's `SFTTrainer` on the same model, examples and masks.

An independent implementation: TRL 1.x prepares prompt/completion examples (`completion_only_loss`: the
loss on completion tokens only), and its padding-free collator packs them into one row with positions
restarting per example (transformers keeps the examples apart in attention from those positions); its
Trainer takes one SGD step with learning rate 1, so the change of every weight is minus its gradient.
ndtrain gets the same tokens as (tokens, targets with −100, positions) and takes the same step, float64.
transformers' own causal-LM loss casts the logits to float32 (`ForCausalLMLoss`), which alone moves the
loss by ~1e-6; the trainer is therefore handed the same formula without that cast (`float64_loss`: shift
the labels, sum of cross-entropies over the targets / the trainer's count of targets in the whole batch).
- packed: the whole batch as one packed row (document masks + the loss over the targets);
- accumulated: TRL with one example per micro-batch and gradient accumulation (it divides by the
  number of targets in the whole batch), ndtrain with one right-padded example per micro-batch; the
  examples hold 5, 2 and 7 targets, so a mean of per-micro-batch means would differ.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from ndtrain.config import ParallelConfig
from ndtrain.dist.mesh import init
from ndtrain.engine import Engine
from ndtrain.models.causal_lm import CausalLM
from ndtrain.parallel.target_mean import IGNORE_INDEX
from tests.helpers.parity import relative_errors

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

TOLERANCE = 1e-6  # the bound; float64 on both sides, so what remains is summation order
VOCAB, PAD, EOS = 64, 0, 1
EXAMPLES = [(9, 5), (6, 5), (14, 8)]  # (tokens before EOS, prompt tokens): 5, 2 and 7 targets

pytestmark = pytest.mark.usefixtures("one_thread")


def base_model() -> Any:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def examples() -> list[dict[str, list[int]]]:
    """Tokenized prompt/completion examples as TRL takes them: input_ids and completion_mask (EOS ends each)."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for length, prompt in EXAMPLES:
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist() + [EOS]
        rows.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * (length + 1 - prompt)})
    return rows


def float64_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ForCausalLMLoss in the logits' own dtype: labels shifted left (−100 appended), the
    cross-entropy summed over the targets and divided by the trainer's count for the whole batch."""
    logits = outputs.logits
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX,
                                              reduction="sum")
    return total / num_items_in_batch


def trl_step(model: Any, per_device: int, accumulation: int, folder: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One SFTTrainer step (SGD, learning rate 1, no clipping): its logged loss and every weight's gradient."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0")), pad_token="t0",
        eos_token="t1")
    args = trl.SFTConfig(
        output_dir=folder, padding_free=True, completion_only_loss=True, max_length=None, shuffle_dataset=False,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, max_steps=1,
        learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=0.0, report_to="none", use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True,
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(examples()),
                             processing_class=tokenizer, compute_loss_func=float64_loss)
    trainer.train()
    loss = trainer.state.log_history[0]["loss"]
    return loss, {name: before[name] - p.detach() for name, p in model.named_parameters()}


def packed_row() -> tuple[torch.Tensor, ...]:
    """The examples as one packed window: tokens, targets (−100 on prompts and across boundaries), positions."""
    ids = [t for row in examples() for t in row["input_ids"]]
    labels = [t if m else IGNORE_INDEX for row in examples() for t, m in zip(row["input_ids"], row["completion_mask"])]
    positions = [i for row in examples() for i in range(len(row["input_ids"]))]
    ids, labels, positions = (torch.tensor([v]) for v in (ids, labels, positions))
    return ids[:, :-1], labels[:, 1:], positions[:, :-1]


def padded_rows() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One example per micro-batch, right-padded to the longest (padding: PAD tokens, −100 targets)."""
    width = max(len(row["input_ids"]) for row in examples())
    out = []
    for row in examples():
        pad = width - len(row["input_ids"])
        ids = torch.tensor([row["input_ids"] + [PAD] * pad])
        labels = torch.tensor([[t if m else IGNORE_INDEX for t, m in zip(row["input_ids"], row["completion_mask"])]
                               + [IGNORE_INDEX] * pad])
        out.append((ids[:, :-1], labels[:, 1:]))
    return out


def ndtrain_step(model: Any, micro_batches: list[tuple[torch.Tensor, ...]]) -> tuple[float, dict[str, torch.Tensor]]:
    engine = Engine(lambda: CausalLM(model), lambda groups: torch.optim.SGD(groups, lr=1.0), init(ParallelConfig()),
                    ParallelConfig())
    before = engine.full_state_dict()
    loss = engine.train_step(micro_batches).loss
    after = engine.full_state_dict()
    return loss, {name.removeprefix("hf."): before[name] - after[name] for name in after if name in before
                  and after[name].is_floating_point() and name.removeprefix("hf.") in dict(model.named_parameters())}


@pytest.mark.parametrize("mode", ["packed", "accumulated"])
def test_loss_and_gradients_equal_trl(mode: str, tmp_path: Any) -> None:
    model = base_model()
    per_device, accumulation = (len(EXAMPLES), 1) if mode == "packed" else (1, len(EXAMPLES))
    want_loss, want = trl_step(copy.deepcopy(model), per_device, accumulation, str(tmp_path))
    got_loss, got = ndtrain_step(copy.deepcopy(model), [packed_row()] if mode == "packed" else padded_rows())
    assert got_loss == pytest.approx(want_loss, rel=TOLERANCE)
    errors = relative_errors(got, want)
    assert max(errors.values()) <= TOLERANCE, sorted(errors.items(), key=lambda e: -e[1])[:3]
    assert min(g.abs().max().item() for g in want.values()) > 0  # every weight moved: the comparison is not of zeros
