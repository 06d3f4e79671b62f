"""What the trainer trains: a `Task` gives the data sets, the model and any evaluation beyond the loss.

`build_task(cfg)` picks the task registered in `TASKS` under `model.preset`; every other preset
is the byte-level language-model task (Llama on a text corpus). A task's data sets hold items
(x, y) that the trainer stacks into (inputs, targets) batches; the model's `forward(x, y)`
returns the mean loss; the engine counts `y.numel()` per batch as the step's tokens, so the
unit of that count is the task's `unit` (tokens for the language model, images for digits), and the
loss is in `loss_unit`: nats per predicted item (`loss_unit`: per byte for the byte tokenizer, per token
for any other, plain nats for digits' classifier), what the summary, loss plot and report print.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from torch import nn

from ndtrain.config import TrainConfig
from ndtrain.engine import Engine


RETRIEVAL_METRICS = ("map", "cmc1", "cmc5")


class ItemSet(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Any: ...


@dataclass(frozen=True)
class Task:
    train_set: ItemSet
    val_set: ItemSet
    model_fn: Callable[[], nn.Module]       # the whole model, seeded: identical on every rank
    data_description: str                   # where the data come from
    items: str                              # what one item is, e.g. "windows of 128 tokens"
    unit: str = "tokens"                    # what StepResult.tokens counts
    loss_unit: str = "nats/byte"            # loss_unit(preset, tokenizer)
    outputs: int = 0                        # the values one prediction chooses among (the loss plot's
                                            # uniform guess at ln outputs); 0: none drawn
    evaluate: Callable[[Engine], dict[str, float]] | None = None  # extra metrics at each evaluation (collective)
    test: Callable[[Engine], dict[str, float]] | None = None  # the final score on held-out data, at the last step only
    metrics: tuple[str, ...] = ()           # the names `evaluate` and `test` return, for the summary table


def language_model_task(cfg: TrainConfig) -> Task:
    """The config's model (built-in Llama preset or hf:PATH, with model.init_from) on windows of seq_len+1 tokens of `data.path` (default: Python's own source), read
    from the token file that `data/prepare.py` builds."""
    from ndtrain.data.prepare import prepare_data
    from ndtrain.checkpoint.run_model import build_run_model

    data = prepare_data(cfg.data, cfg.model.seq_len, Path(cfg.log.out))
    return Task(
        train_set=data.train,
        val_set=data.val,
        model_fn=lambda: build_run_model(cfg.model, cfg.seed),
        data_description=_with_tokenizer_origin(data.description, cfg),
        items=f"windows of {cfg.model.seq_len} tokens",
        loss_unit=loss_unit(cfg.model.preset, cfg.data.tokenizer),
        outputs=cfg.model.vocab_size,
    )


def loss_unit(preset: str, tokenizer: str) -> str:
    """The unit of a run's loss: nats per byte or per token (data/tokenizer.py `token_unit`) for the language
    model, nats for a task preset (digits' classifier)."""
    from ndtrain.data.tokenizer import token_unit

    return "nats" if preset in TASKS else f"nats/{token_unit(tokenizer)}"


def _with_tokenizer_origin(description: str, cfg: TrainConfig) -> str:
    """The data description with its tokenizer part saying, for an `hf:PATH` model, whose tokenizer it is."""
    from ndtrain.data.tokenizer import folder_tokenizer
    from ndtrain.models.hf import hf_path, is_hf_model

    if not is_hf_model(cfg.model.preset):
        return description
    own = folder_tokenizer(hf_path(cfg.model.preset))
    if own == cfg.data.tokenizer:
        origin = "the model's own"
    elif own is None:
        origin = "the model folder has none"
    else:
        origin = f"data.tokenizer, not the model's own {own}"
    part = f"tokenizer {cfg.data.tokenizer}"
    return description.replace(part, f"{part} ({origin})", 1)


def digits_task(cfg: TrainConfig) -> Task:
    """The digits CNN (models/digits.py) on scikit-learn's digits; retrieval mAP/CMC on the validation split at
    each evaluation, on the test split once at the last step (`test_map`, ...)."""
    from ndtrain.checkpoint.run_model import build_run_model
    from ndtrain.data.digits import RetrievalSplit, load_digits_split
    from ndtrain.eval.retrieval import evaluate_retrieval

    split = load_digits_split()

    def retrieval(held_out: RetrievalSplit, prefix: str) -> Callable[[Engine], dict[str, float]]:
        def measure(engine: Engine) -> dict[str, float]:
            engine.model.eval()
            embed = lambda x: engine.wrapped(x.to(engine.ctx.device, engine.compute_dtype))
            metrics = evaluate_retrieval(embed, held_out.query.labeled(), held_out.gallery.labeled(), engine.ctx,
                                         group="dp")
            return {prefix + k: metrics[k] for k in RETRIEVAL_METRICS}
        return measure

    sizes = lambda s: f"query {len(s.query)} / gallery {len(s.gallery)}"
    return Task(
        train_set=split.train,
        val_set=split.val.joined,
        model_fn=lambda: build_run_model(cfg.model, cfg.seed),
        data_description=f"scikit-learn digits (validation {sizes(split.val)}; test {sizes(split.test)}, at the end)",
        items="8×8 images",
        unit="images",
        loss_unit=loss_unit(cfg.model.preset, cfg.data.tokenizer),
        evaluate=retrieval(split.val, ""),
        test=retrieval(split.test, "test_"),
        metrics=(*RETRIEVAL_METRICS, *(f"test_{k}" for k in RETRIEVAL_METRICS)),
    )


TASKS: dict[str, Callable[[TrainConfig], Task]] = {"digits": digits_task}


def build_task(cfg: TrainConfig) -> Task:
    return TASKS.get(cfg.model.preset, language_model_task)(cfg)
