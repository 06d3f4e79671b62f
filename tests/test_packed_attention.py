"""Packed documents never see each other: per-row positions [B, T] that restart at 0 where a document
starts (parallel/model/documents.py) mask attention across documents and drive RoPE, in every layout.

Single process, float64: every document of a packed batch gets the logits it gets alone (the built-in
Llama; a tiny Hugging Face Llama under sdpa and eager); without the mask they would not (the test
that fails when masking is removed). Ring attention on its own: packed q/k/v against the masked
single-process attention, including fully masked tiles. Two gloo ranks: one engine step of a packed
float64 batch under tp2 + sequence parallel, pp2 and cp2 (the built-in Llama, cp also with
selective recompute; the HF Llama under cp2, tp2 and pp2) gives the single-process loss and gradients;
a model of the user's own that takes no positions is refused packed documents.

The batch: row 0 continues a document (positions 3, 4, ...) then holds documents starting at 6 and
11 (inside the cp chunks of 4 tokens); row 1 holds documents starting at 4 and 8 (exactly at chunk
edges), its last spanning the chunks of both cp ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import ParallelConfig, config_from_dict
from ndtrain.dist.mesh import init
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.models.llama import build_model
from ndtrain.parallel.model.context import Ring, ring_attention, shard_sequence
from ndtrain.parallel.model.documents import Documents
from tests.helpers.runner import case_result, init_method, run_distributed, run_each

SEQ = 16
LENGTHS = ((6, 5, 5), (4, 4, 8))  # documents per row
FIRST = (3, 0)  # the first document's first position per row (row 0's continues a document)
VOCAB = 64
TOL = 1e-12
EAGER_TOL = 1e-6  # transformers' eager attention takes its softmax in float32 even for a float64 model
LAYOUT_TOL = 1e-10
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
    "cp2-selective": dict(cp=2, recompute="selective"),
    "hf-cp2": dict(cp=2),
    "hf-tp2": dict(tp=2),
    "hf-pp2": dict(pp=2),
}

pytestmark = pytest.mark.usefixtures("one_thread")


def packed_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) + (first if i == 0 else 0) for i, n in enumerate(row)])
                        for row, first in zip(LENGTHS, FIRST)])


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (len(LENGTHS), SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:], packed_positions()


def llama() -> torch.nn.Module:
    cfg = config_from_dict({"model": {"preset": "tiny", "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                      "ffn_dim": 64, "seq_len": SEQ, "vocab_size": VOCAB}}).model
    return build_model(cfg, seed=0).to(torch.float64)


def hf_llama(attention: str = "sdpa") -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    from ndtrain.models.causal_lm import CausalLM

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation=attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(config)
    return CausalLM(hf).to(torch.float64)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def document_errors(model: torch.nn.Module, positions: torch.Tensor) -> float:
    """Largest relative difference between a document's logits in the packed batch and alone."""
    tokens, _, _ = packed_batch()
    packed = model(tokens, None, positions)
    errors = []
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            alone = model(tokens[row:row + 1, start:start + n], None, packed_positions()[row, start:start + n])
            errors.append(rel(packed[row, start:start + n], alone[0]))
            start += n
    return max(errors, key=lambda e: e if e == e else float("inf"))


@pytest.mark.parametrize("name", ["llama", "hf-sdpa", "hf-eager"])
def test_each_document_gets_its_own_logits(name: str) -> None:
    model = llama() if name == "llama" else hf_llama(name.removeprefix("hf-"))
    err = document_errors(model, packed_positions())
    assert err <= (EAGER_TOL if name == "hf-eager" else TOL), f"{name}: a packed document's logits differ from its own by {err:.3g}"


@pytest.mark.parametrize("name", ["llama", "hf-sdpa"])
def test_documents_see_each_other_without_positions(name: str) -> None:
    """The check above can fail: positions 0..T−1 for every row (no documents) give other logits."""
    model = llama() if name == "llama" else hf_llama("sdpa")
    shared = torch.arange(SEQ).expand(len(LENGTHS), -1)
    assert document_errors(model, shared) > 1e-3


def test_one_document_per_row_keeps_the_causal_fast_path() -> None:
    assert Documents(torch.arange(5, 5 + SEQ).expand(2, -1)).causal_mask() is None
    mask = Documents(packed_positions()).causal_mask()
    assert mask is not None and mask.shape == (2, 1, SEQ, SEQ)
    assert not mask[0, 0, 6, 5] and mask[0, 0, 5, 0] and not mask[1, 0, 8, 7] and mask[1, 0, 15, 8]


# ------------------------------------------------------------------------------------ two ranks
def _ring(name: str) -> dict[str, float]:
    """Ring attention (tiles of 3: tiles inside chunks, some wholly across documents) on packed q/k/v."""
    ctx = init(ParallelConfig(cp=2), init_method=init_method())
    positions = packed_positions()
    _, _, local_positions = shard_sequence(positions, positions, ctx, positions)
    _, _, local = shard_sequence(positions, positions, ctx)  # this rank's row indices
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, SEQ, 8, generator=gen, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    grad = torch.randn(2, 4, SEQ, 8, generator=gen, dtype=torch.float64)
    mask = Documents(positions).causal_mask()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    mine = [t.detach()[:, :, local].requires_grad_() for t in (q, k, v)]
    errors = {}
    for kernel in ("tiles", "fused"):  # positions given: the tiles kernel whatever the setting
        out = ring_attention(*mine, Ring(ctx.comm, ctx.group("cp"), tile=3, kernel=kernel), positions=local_positions)
        grads = torch.autograd.grad(out, mine, grad[:, :, local])
        errors[f"{kernel} out"] = rel(out, ref[:, :, local])
        errors.update({f"{kernel} d{n}": rel(g, r[:, :, local]) for n, g, r in zip("qkv", grads, ref_grads)})
    return errors


def _refused(name: str) -> str:
    """A model of the user's own that takes no positions, given packed documents: refused in one line."""
    parallel = ParallelConfig(dp=2)
    ctx = init(parallel, init_method=init_method())
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    engine = Engine(lambda: model, lambda groups: torch.optim.SGD(groups, lr=1.0), ctx, parallel,
                    loss_fn=lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    tokens, targets, positions = packed_batch()
    try:
        engine.train_step([(tokens[:1], targets[:1], positions[:1])])
    except UserError as error:
        return str(error)
    return "not refused"


def _step(name: str) -> dict[str, float]:
    """One SGD (lr 1) engine step on the packed batch in two micro-batches of one row against the
    single-process loss and gradients."""
    parallel = ParallelConfig(**LAYOUTS[name])
    ctx = init(parallel, init_method=init_method())
    hf = name.startswith("hf")
    build = hf_llama if hf else llama
    tokens, targets, positions = packed_batch()
    micro = [(tokens[i:i + 1], targets[i:i + 1], positions[i:i + 1]) for i in range(len(LENGTHS))]
    reference = build()
    ref_loss = sum(reference(*batch) for batch in micro) / len(micro)
    ref_loss.backward()
    engine = Engine(build, lambda groups: torch.optim.SGD(groups, lr=1.0), ctx, parallel)
    before = engine.full_state_dict()
    loss = engine.train_step(micro).loss
    after = engine.full_state_dict()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    errors = {"loss": abs(loss - ref_loss.item()) / abs(ref_loss.item())}
    worst = 0.0
    for key in grads.keys() & before.keys():  # a pipeline stage's state holds its own parameters
        worst = max(worst, rel(before[key] - after[key], grads[key]), key=lambda e: e if e == e else float("inf"))
    errors["grads"] = worst
    return {"errors": errors, "missing": grads.keys() - before.keys()}


def _all() -> dict[str, Any]:
    return {**run_each(_ring, ["ring"]), **run_each(_step, list(LAYOUTS)), **run_each(_refused, ["refused"])}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_all, 2, timeout=300)


def test_ring_attention_keeps_documents_apart(runs: list[dict[str, Any]]) -> None:
    for errors in case_result(runs, "ring"):
        for what, err in errors.items():
            assert err <= TOL, f"ring attention {what}: relative error {err:.3g}"


def test_a_model_without_positions_is_refused_packed_documents(runs: list[dict[str, Any]]) -> None:
    for message in case_result(runs, "refused"):
        assert message.startswith("packed documents need a model that takes positions") and "\n" not in message


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_packed_documents_like_one_process(name: str, runs: list[dict[str, Any]]) -> None:
    results = case_result(runs, name)
    assert not set.intersection(*(result["missing"] for result in results)), "some parameters compared on no rank"
    for result in results:
        for what, err in result["errors"].items():
            assert err <= LAYOUT_TOL, f"{name} {what}: relative error {err:.3g}"
