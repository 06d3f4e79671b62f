"""A digits run end to end, in one process: the fixed train / validation / test split, evaluations on
the validation split with the test split scored once at the end, `ndtrain export` of its model (and
`--format hf` refused in one line), the progress line's unit, `ndtrain inspect` and `generate`."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from ndtrain.checkpoint.export import export_safetensors
from ndtrain.checkpoint.init_from import load_init_weights
from ndtrain.cli.commands import main as cli_main
from ndtrain.config import load_config
from ndtrain.console import log
from ndtrain.data.digits import ImageSet, RetrievalSplit, load_digits_split
from ndtrain.dist.mesh import init
from ndtrain.errors import UserError
from ndtrain.eval.retrieval import evaluate_retrieval
from ndtrain.generate import generate_text
from ndtrain.models.digits import DigitsNet, build_digits_model
from ndtrain.run.inspect import _trained_on, inspect_run
from ndtrain.run.progress import format_line
from ndtrain.trainer import Trainer

STEPS, BATCH = 4, 16


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@dataclass(frozen=True)
class Run:
    path: Path
    summary: dict[str, object]
    weights: dict[str, torch.Tensor]
    log_lines: list[str]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> Run:
    """`--model digits` for 4 steps in one process, evaluating at steps 2 and 4, progress lines every 2."""
    out = tmp_path_factory.mktemp("digits") / "run"
    cfg = load_config(None, {"model.preset": "digits", "log.out": str(out), "log.progress": "lines",
                             "schedule.steps": STEPS, "schedule.global_batch": BATCH, "schedule.micro_batch": 8,
                             "schedule.warmup_steps": 1, "log.eval_every": 2, "log.every": 2, "parallel.dp": 1})
    lines, level = Lines(), log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        trainer = Trainer(cfg, init(cfg.parallel))
        summary = trainer.run()
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    return Run(out, summary, trainer.engine.full_state_dict(), lines.messages)


def rows(images: ImageSet) -> set[bytes]:
    """Each (image, label) as bytes: equal items are equal rows."""
    joined = torch.cat([images.images.flatten(1), images.labels[:, None].float()], dim=1)
    return {row.numpy().tobytes() for row in joined}


def test_split_is_fixed_disjoint_and_keeps_the_test_set_apart() -> None:
    split, again = load_digits_split(), load_digits_split()
    sizes = lambda s: (len(s.joined), len(s.query), len(s.gallery))
    assert (len(split.train), sizes(split.val), sizes(split.test)) == (1005, (252, 84, 168), (540, 180, 360))
    for name in ("images", "labels"):  # independent of any seed: the same split every time
        assert torch.equal(getattr(split.train, name), getattr(again.train, name))
        assert torch.equal(getattr(split.val.query, name), getattr(again.val.query, name))
    train, val, test = rows(split.train), rows(split.val.joined), rows(split.test.joined)
    assert len(train) + len(val) + len(test) == 1797  # no image in two sets (nor twice in one)
    assert not (train & val or train & test or val & test)
    for held_out in (split.val, split.test):  # every class queries and is found
        assert set(held_out.query.labels.tolist()) == set(held_out.gallery.labels.tolist()) == set(range(10))
        assert torch.equal(held_out.joined.labels, torch.cat([held_out.query.labels, held_out.gallery.labels]))


def retrieval_of(model: DigitsNet, held_out: RetrievalSplit) -> dict[str, float]:
    ctx = init(load_config(None, {"parallel.dp": 1}).parallel)
    return evaluate_retrieval(model, held_out.query.labeled(), held_out.gallery.labeled(), ctx)


def test_evaluations_use_the_validation_split_and_the_test_split_only_at_the_end(run: Run) -> None:
    records = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "map" in r] == [2, 4]
    assert [r["step"] for r in records if "test_map" in r] == [STEPS]
    model = DigitsNet(64)
    model.load_state_dict(run.weights)
    model.eval()
    split = load_digits_split()
    val, test = retrieval_of(model, split.val), retrieval_of(model, split.test)
    for key in ("map", "cmc1", "cmc5"):  # the same embeddings in the same batches: equal exactly
        assert run.summary[key] == val[key] and run.summary[f"test_{key}"] == test[key], key
    assert val["queries"] == 84 and test["queries"] == 180
    with torch.no_grad():
        losses = {name: F.cross_entropy(model.classifier(model.embedding(s.joined.images)), s.joined.labels).item()
                  for name, s in (("val", split.val), ("test", split.test))}
    assert run.summary["val_loss"] == pytest.approx(losses["val"], rel=1e-6)
    assert run.summary["val_loss"] != pytest.approx(losses["test"], rel=1e-5)  # not the test set's loss


def test_export_writes_the_digits_model(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "digits.safetensors"
    checkpoint, count = export_safetensors(run.path, out)
    assert checkpoint.name == f"step_{STEPS:08d}"
    tensors = load_file(str(out))
    assert set(tensors) == set(DigitsNet(64).state_dict()) and count == len(tensors) == 12
    for name, value in run.weights.items():
        assert torch.equal(tensors[name], value), name
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["model_config"])["preset"] == "digits"
    moved = build_digits_model(64, 0)
    load_init_weights(moved, out)  # --init-from takes the export back
    assert all(torch.equal(moved.state_dict()[k], v) for k, v in run.weights.items())

    folder = tmp_path / "hf"
    assert cli_main(["export", str(run.path), str(folder), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--format hf holds language models" in err and "--format safetensors" in err
    assert not folder.exists() and not (tmp_path / "hf.partial").exists()


def test_progress_lines_count_images(run: Run) -> None:
    progress = [line for line in run.log_lines if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["2/4", "4/4"]
    assert all(" images/s | " in line and "tok/s" not in line for line in progress), progress
    assert "| 7,403 images/s |" in format_line(5, 9, loss=1.0, tokens_per_s=7403.2, s_per_step=0.5, unit="images")
    assert "| 7,403 tok/s |" in format_line(5, 9, loss=1.0, tokens_per_s=7403.2, s_per_step=0.5)


def test_inspect_shows_what_applies_to_a_digits_run(run: Run) -> None:
    text = inspect_run(run.path)
    fields = dict(line.split(None, 1) for line in text.split("\ntensors:")[0].splitlines())
    assert fields["model"] == "digits (cnn)" and fields["model.dim"] == "64"
    assert fields["images"] == f"{STEPS * BATCH:,}"
    assert "seq_len" not in fields and "tokens" not in fields
    assert "  features.0.weight  32×1×3×3" in text
    assert _trained_on({"tokens": 64}, language_model=False) == (
        "trained on", "64 items (unit not recorded: checkpoint older than the record)")
    assert _trained_on({"tokens": 64}, language_model=True) == ("tokens", "64")


def test_generate_refuses_a_digits_run(run: Run) -> None:
    with pytest.raises(UserError, match="trained --model digits, which does not generate text"):
        generate_text(run.path, "x", 4, 0.0, 0, 0)
