"""LoRA (`[lora]`, parallel/model/lora.py): adapters on the named linear layers, the rest frozen.

- One process, fp32: the trainable parameters are exactly Σ r·(in + out) over the targets, the
  gradients 4 bytes and AdamW's moments 2 × 4 bytes each of them, nothing for the frozen base, whose
  weights stay bit-identical while the adapters move.
- Parity, float64, 2 ranks: dp2, ZeRO-1/2/3, tp2 (with and without sequence parallelism, every adapter
  split with its base) and pp2 end where one process ends (≤ 1e-9 relative), the base bit-identical, no
  rank holding gradient for it; an HF Llama's q/v/o_proj adapters likewise under its own tp plan.
- Checkpoints hold adapters and base under unsharded names: ZeRO-3's, tp2's and pp2's load into one process.
- Export: `--format peft` loads with `peft.PeftModel.from_pretrained` onto the HF base model and gives
  ndtrain's logits (built-in Llama and an hf:PATH Llama); `--format hf` and the in-memory conversion
  merge the adapters (W + B A · alpha/r) and give them too.
- Refusals: a target matching no linear layer (naming those that exist; by the launcher too, before any
  worker), r < 0, no targets, and the layouts LoRA does not run under, each one line.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ndtrain.checkpoint.export_hf import export_hf
from ndtrain.checkpoint.export_peft import export_peft
from ndtrain.checkpoint.run_model import build_run_model, load_run
from ndtrain.config import ParallelConfig, load_config
from ndtrain.dist.mesh import init
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.models.llama import build_model
from ndtrain.models.llama_hf import builtin_to_hf
from ndtrain.parallel.model.lora import apply_lora, lora_layers
from ndtrain.parallel.model.tensor import ReplicatedHeadsLinear
from ndtrain.parallel.placement import is_tensor_parallel
from ndtrain.run.layout_check import check_layout_on_meta
from ndtrain.trainer import Trainer
from tests.helpers.layouts import BF16_LOSS_TOLERANCE, DTYPE, MAX_NORM, MODEL, State, adamw, batch
from tests.helpers.models import shard
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import Reference, train_reference
from tests.helpers.runner import case_result, init_method, run_distributed, run_each
from tests.helpers.runs import corpus_file, tiny_config

R, ALPHA, TARGETS = 4, 8.0, ["wq", "wv", "w2"]  # wq, wv column-parallel under tp; w2 row-parallel
STEPS = 3
CASES: dict[str, dict[str, Any]] = {
    "dp2": dict(dp=2),
    "zero1": dict(dp=2, zero=1),
    "zero2": dict(dp=2, zero=2),
    "zero3": dict(dp=2, zero=3),
    "tp2": dict(dp=1, tp=2),
    "tp2-sp": dict(dp=1, tp=2, sequence_parallel=True),
    "pp2": dict(dp=1, pp=2),
    "hf-tp2": dict(dp=1, tp=2),  # an HF Llama under its own tp plan: q_proj, v_proj colwise, o_proj rowwise
}
BF16 = {"zero3-bf16": dict(dp=2, zero=3, precision="bf16")}  # float64 masters, bf16 compute: losses compared
HF_TARGETS = ["q_proj", "v_proj", "o_proj"]


def lora_model(dtype: torch.dtype = DTYPE) -> nn.Module:
    return apply_lora(build_model(MODEL, seed=0).to(dtype), TARGETS, R, ALPHA, 0.0, seed=0)


def hf_lora_model() -> nn.Module:
    """A float64 HF Llama (hidden 64, 2 layers, 4 heads, 2 kv heads) in ndtrain's CausalLM, with adapters."""
    from tests.helpers.hf import make_model  # needs transformers

    return apply_lora(make_model("llama"), HF_TARGETS, R, ALPHA, 0.0, seed=0)


def case_model(case: str) -> nn.Module:
    return hf_lora_model() if case.startswith("hf-") else lora_model()


def trainable_formula(model: nn.Module) -> int:
    """Σ r·(in + out) over the adapted layers."""
    return sum(R * (m.in_features + m.out_features) for m in lora_layers(model).values())


def base_names(state: State) -> list[str]:
    return [name for name in state if ".lora." not in name]


# ------------------------------------------------------------------------------------ one process
def test_only_adapters_train_and_hold_state(one_thread: None) -> None:
    parallel = ParallelConfig(dp=1)
    engine = Engine(lambda: lora_model(torch.float32), adamw, init(parallel), parallel)
    initial = {k: v.clone() for k, v in engine.full_state_dict().items()}
    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    count = trainable_formula(engine.model)
    assert count == 4 * (R * (32 + 32) + R * (32 + 16) + R * (64 + 32))  # 4 layers of wq, wv (2 kv heads), w2
    assert sum(p.numel() for p in trainable) == count
    for s in range(2):
        engine.train_step([batch(s)])
    held = engine.model_state_bytes()
    assert held["gradients"] == 4 * count
    state = engine.optimizer.state
    assert {id(p) for p in state} == {id(p) for p in trainable}
    moments = sum(s[k].numel() * s[k].element_size() for s in state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert moments == 2 * 4 * count
    assert held["optimizer"] == moments + sum(s["step"].numel() * s["step"].element_size() for s in state.values())
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], initial[k]) for k in base_names(initial))
    assert all(not torch.equal(after[k], initial[k]) for k in initial if k.endswith("lora.B"))
    assert all(p.grad is None for p in engine.model.parameters() if not p.requires_grad)


# ------------------------------------------------------------------------------------ parity
@functools.cache
def reference(hf: bool) -> Reference:
    model = hf_lora_model() if hf else lora_model()
    optimizer = adamw([{"params": [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]},
                       {"params": [p for p in model.parameters() if p.requires_grad and p.ndim < 2],
                        "weight_decay": 0.0}])
    return train_reference(model, optimizer, map(batch, range(STEPS)), clip=MAX_NORM)


def _case(root: str, case: str) -> dict[str, Any]:
    parallel = ParallelConfig(**{**CASES, **BF16}[case])
    ctx = init(parallel, init_method=init_method())
    engine = Engine(lambda: case_model(case), adamw, ctx, parallel, grad_clip=MAX_NORM)
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    losses = [engine.train_step(shard(batch(s), rank, dp, 2)).loss for s in range(STEPS)]
    engine.save(f"{root}/{case}")
    split = [n for n, p in engine.model.named_parameters() if ".lora." in n and is_tensor_parallel(p)]
    return {"state": engine.full_state_dict(), "bytes": engine.model_state_bytes(), "split": split, "losses": losses}


def _cases(root: str) -> dict[str, Any]:
    return run_each(lambda case: _case(root, case), [*CASES, *BF16])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def runs(root: Path) -> list[dict[str, Any]]:
    return run_distributed(_cases, 2, str(root), timeout=600)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", list(CASES))
def test_lora_under_layout_equals_one_process(case: str, runs: list[dict[str, Any]]) -> None:
    if case.startswith("hf-"):
        pytest.importorskip("transformers")
    expected = reference(case.startswith("hf-")).state
    model = case_model(case)
    initial = model.state_dict()
    count = trainable_formula(model)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    state: State = {}
    for run in case_result(runs, case):
        state.update(run["state"])  # a pipeline stage's, or the whole model
        # float64: at most a bucket and a shard (ZeRO-1) of the adapters' gradient; the base has 16× their elements
        assert run["bytes"]["gradients"] <= 2 * 8 * count < 8 * frozen // 4
        if case == "dp2":
            assert run["bytes"]["gradients"] == 8 * count
        if "tp2" in case:  # every adapter has one matrix split with its base layer
            assert len(run["split"]) == len(lora_layers(model)), run["split"]
        if case in ("dp2", "zero1", "zero2"):  # parameters replicated: the frozen base counted whole, once
            assert run["bytes"]["parameters"] == 8 * (frozen + count)
        if case == "zero3":  # base and adapters sharded over the 2 ranks (padding: < 2 elements per unit)
            assert 8 * (frozen + count) // 2 <= run["bytes"]["parameters"] < 8 * (frozen + count) // 2 + 8 * 4 * 6
    assert all(torch.equal(state[k], initial[k]) for k in base_names(initial)), "a frozen weight moved"
    assert all(not torch.equal(state[k], initial[k]) for k in initial if k.endswith("lora.B"))
    assert_params_close(state, expected, 1e-9, case)


@pytest.mark.usefixtures("one_thread")
def test_bf16_zero3_keeps_the_frozen_base_and_follows_the_loss(runs: list[dict[str, Any]]) -> None:
    """ZeRO-3 computes in bf16 from float64 master shards of base and adapters: the base stays bit-identical."""
    reference_losses = reference(False).losses
    initial = lora_model().state_dict()
    for run in case_result(runs, "zero3-bf16"):
        assert all(torch.equal(run["state"][k], initial[k]) for k in base_names(initial))
        assert all(abs(a - b) <= BF16_LOSS_TOLERANCE for a, b in zip(run["losses"], reference_losses, strict=True))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", ["zero3", "tp2", "pp2"])
def test_checkpoint_of_a_layout_loads_into_one_process(case: str, root: Path, runs: list[dict[str, Any]]) -> None:
    """Adapters and base are stored under their unsharded names: one process gets the run's exact weights."""
    parallel = ParallelConfig(dp=1)
    engine = Engine(lora_model, adamw, init(parallel), parallel)
    assert engine.load(root / case)["step"] == STEPS
    state: State = {}
    for run in case_result(runs, case):
        state.update(run["state"])
    loaded = engine.full_state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


# ------------------------------------------------------------------------------------ export
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's call
def test_export_peft_and_merged_hf_give_ndtrains_logits(tmp_path: Path, one_thread: None,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = tiny_config(corpus_file(tmp_path), str(tmp_path / "run"), **{
        "parallel.dp": 1, "schedule.steps": 3, "optim.lr": 1e-2, "lora.r": R, "lora.alpha": ALPHA,
        "lora.targets": ["wq", "wv", "w2"]})
    Trainer(cfg, init(cfg.parallel)).run()
    _, ours, _ = load_run(Path(cfg.log.out))
    count = trainable_formula(ours)
    assert f"ndtrain: LoRA r={R}, alpha={ALPHA:g} on wq, wv, w2: {count:,} trainable of " in capsys.readouterr().out
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(tokens)
    start = build_run_model(cfg.model, cfg.seed)  # the base the run started from (the adapters aside, frozen)
    base = builtin_to_hf(start, cfg.model)
    _, files = export_peft(Path(cfg.log.out), tmp_path / "adapter")
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        got = adapted(input_ids=tokens).logits
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-6, f"peft logits differ by {err:.3e}"
    with adapted.disable_adapter(), torch.no_grad():
        assert not torch.allclose(adapted(input_ids=tokens).logits, want, atol=1e-4)  # the adapters matter
    export_hf(Path(cfg.log.out), tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True)
    with torch.no_grad():
        err = ((merged(input_ids=tokens).logits - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-6, f"merged logits differ by {err:.3e}"
    with pytest.raises(UserError, match="already exists"):
        export_peft(Path(cfg.log.out), tmp_path / "adapter")


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's call
def test_hf_model_adapters_export_to_peft(tmp_path: Path, one_thread: None) -> None:
    """An hf:PATH Llama with q_proj/v_proj adapters: peft on the model the run started from gives the run's logits."""
    peft = pytest.importorskip("peft")
    from tests.helpers.hf import hf_dir, hf_run_config  # needs transformers

    cfg = hf_run_config(corpus_file(tmp_path), str(tmp_path / "run"), hf_dir(tmp_path, "llama"), **{
        "parallel.dp": 1, "schedule.steps": 2, "optim.lr": 1e-2, "lora.r": R, "lora.targets": ["q_proj", "v_proj"]})
    Trainer(cfg, init(cfg.parallel)).run()
    _, ours, _ = load_run(Path(cfg.log.out))
    assert {n.rpartition(".")[2] for n in lora_layers(ours)} == {"q_proj", "v_proj"}
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    export_peft(Path(cfg.log.out), tmp_path / "adapter")
    base = build_run_model(cfg.model, cfg.seed).hf.eval()
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want, got = ours(tokens), adapted(input_ids=tokens).logits
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-6, f"peft logits differ by {err:.3e}"


def test_builtin_conversion_merges_the_adapters() -> None:
    """`builtin_to_hf` (generate's and export's conversion) folds W + B A · alpha/r into LlamaForCausalLM."""
    model = lora_model(torch.float32).eval()
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora.B.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = model(tokens), builtin_to_hf(model, MODEL)(input_ids=tokens).logits
    assert lora_layers(model)  # the model itself keeps its adapters
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-6, f"converted logits differ by {err:.3e}"


# ------------------------------------------------------------------------------------ refusals
def test_target_matching_nothing_names_the_linear_layers() -> None:
    with pytest.raises(UserError) as e:
        apply_lora(build_model(MODEL, seed=0), ["q_proj"], R, ALPHA, 0.0, seed=0)
    message = str(e.value)
    assert "\n" not in message and "['q_proj']" in message and "output, w1, w2, w3, wk, wo, wq, wv" in message


@pytest.mark.parametrize(("overrides", "message"), [
    ({"lora.r": -1}, "lora.r must be >= 0"),
    ({"lora.r": 4}, "needs lora.targets"),
    ({"lora.r": 4, "lora.targets": ["wq"], "parallel.precision": "bf16", "parallel.zero": 1},
     "does not combine with parallel.precision=bf16 with zero=1"),
    ({"lora.r": 4, "lora.targets": ["wq"], "lora.dropout": 0.1, "parallel.tp": 2}, "draw different masks"),
    ({"lora.r": 4, "lora.targets": ["wq"], "ps.servers": 1}, "does not combine with ps.servers"),
])
def test_config_refusals_are_one_line(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message) as e:
        load_config(None, overrides).validate()
    assert "\n" not in str(e.value)


def test_replicated_kv_heads_refuse_an_adapter() -> None:
    """tp above the kv heads replicates wk/wv on every rank: an adapter there is refused in one line."""
    model = apply_lora(build_model(dataclasses.replace(MODEL, n_kv_heads=1), seed=0), ["wv"], R, ALPHA, 0.0, seed=0)
    with pytest.raises(UserError, match="replicated over tp"):
        ReplicatedHeadsLinear(model.layers[0].attention.wv, None, None, 0, 8)  # type: ignore[arg-type]


def test_launcher_dry_run_refuses_a_bad_target_before_any_worker() -> None:
    cfg = load_config(None, {"model.preset": "tiny", "lora.r": R, "lora.targets": ["q_proj"]})
    with pytest.raises(UserError, match=r"match no nn.Linear of Llama"):
        check_layout_on_meta(cfg, 2)
    check_layout_on_meta(load_config(None, {"model.preset": "tiny", "lora.r": R, "lora.targets": ["wq", "w2"],
                                            "parallel.tp": 2}), 2)  # splittable: accepted
