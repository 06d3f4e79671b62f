"""How the parallel strategies split a Hugging Face causal LM: its family's `ModelParallel` spec.

Read from the family record (`hf_families.Family`, keyed by `config.model_type`):
- Tensor parallel: the family's plan (a family without one is refused in one line; a model_type
  ndtrain has no family for needs a plan from the user), only behind the `CausalLM` adapter, its
  declared patterns that match nothing in this model dropped; heads from the config. When the plan
  splits the attention per head (colwise q/k/v, GPT-NeoX's per-head fused query_key_value, GPT-2's
  c_attn per third), the attention modules' head counts become local: `num_key_value_groups` (k/v
  projections replicated when tp does not divide the kv heads), `num_heads`, `num_attention_heads`,
  `num_key_value_heads` where a module has them, and GPT-2's `split_size` (its q/k/v width); widths
  such as `embed_dim` stay global (CodeGen divides it by its `mp_num` blocks, which a contiguous split
  keeps whole). A family whose q/k/v are gathered (Phi-3, OLMo2: `colwise_gather_output`) runs whole
  attention and keeps them. With sequence parallelism every layer's attention must be split by the
  plan (it gathers the sequence): one left whole (GPT-OSS declares only its embedding) is refused. The
  adapter's `loss_fn` becomes the vocab-parallel cross-entropy (on logits the family's forward
  soft-capped per shard, Gemma2) and `full_logits` gathers the vocabulary (one all-gather) when
  called without targets. Sequence parallelism cuts the sequence at the first decoder layer's input
  (`SequenceCut`): HF computes the causal mask, positions and RoPE tables from the embedding's output,
  which must therefore span the whole sequence (one all-reduce of b·s·d instead of a reduce-scatter).
  Gemma3n/Gemma4 compute each layer's extra input (`per_layer_input`) from the tokens before the layers:
  those modules see the whole sequence too (complete gradients), and each layer's input is cut to its
  shard like its hidden states (the gradient all-gathered back: b·s·p per layer).
  Symmetrically the sequence is gathered back at the final norm's output rather than at the head's
  input (the same all-gather, moved up one module): the base model's own code after its layers then
  sees whole sequences (GPT-2 reshapes its last hidden states to (−1, T, d), which would silently
  regroup a shard).
- Pipeline: the family's decoder-layer list, cut into `HFStage`s (models/hf_stages.py: each runs the
  family's own forward over its layers); the first stage adds the embeddings, the last the final norm and
  head; a model with parameters outside those parts (`pipeline_refusal`) and `balance=measured` are refused.
- Recomputation: `selective` recomputes each layer's whole attention module (HF has no `attend` seam).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Sequence

import torch
from torch import nn

from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.models.hf_declared import applicable_plan
from ndtrain.models.hf_families import decoder_layers, family_of, hf_config
from ndtrain.models.hf_context import apply_hf_context_parallel
from ndtrain.models.hf_stages import HFStage, end_costs, pipeline_refusal
from ndtrain.parallel.model.context import Ring
from ndtrain.parallel.model_spec import Heads, LossFn, ModelParallel, SequenceCut
from ndtrain.parallel.model.tensor import (
    ColumnParallelLinear, GatherLastDim, GatherSequence, ReplicatedHeadsLinear, SplitSequence,
)
from ndtrain.parallel.model.vocab import VocabParallelCrossEntropy


class HFParallel(ModelParallel):
    """A transformers `*ForCausalLM` (or its `CausalLM` adapter) of a known family, or of an unknown one."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.config: Any = hf_config(model)
        self.family = family_of(model)

    @property
    def name(self) -> str:
        return f"Hugging Face model_type {self.config.model_type!r}"

    def tp_plan(self) -> Mapping[str, str] | None:
        if self.family is not None and self.family.tp_plan is None:
            raise UserError(self.family.tp_refusal)
        return None if self.family is None else applicable_plan(self.model, self.family.tp_plan)

    def check_tensor_parallel(self) -> None:
        if self.family is not None and getattr(self.model, "hf", None) is None:
            raise UserError("tensor parallel on a Hugging Face model needs the adapter: "
                            "pass ndtrain.models.causal_lm.CausalLM(model)")

    def heads(self) -> Heads | None:
        if self.family is None:
            return None
        config = self.config
        attention = self._layers()[0].get_submodule(self.family.attention)
        n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(attention, "head_dim", None) or getattr(attention, "head_size")  # GPT-NeoX: head_size
        return Heads(config.num_attention_heads, n_kv, head_dim, type(attention), self.family.kv_projections,
                     ("config.num_attention_heads", "config.num_key_value_heads"))

    def sequence_cut(self) -> SequenceCut | None:
        if self.family is None:
            return None
        family = self.family
        return SequenceCut(at=f"{family.layers}.0", input_name=family.layer_input,
                           before=tuple(family.embeddings) + self._per_layer_input_modules())

    def _per_layer_input_modules(self) -> tuple[str, ...]:
        """Gemma3n/Gemma4 (`hidden_size_per_layer_input`): the base model's children outside its pipeline
        plan (per-layer embedding, projection, norm) compute every layer's extra input from the tokens before
        the layers run, on the whole sequence (cut per layer by `_SplitPerLayerInput`): their gradients are
        complete. Other families: none (a child outside the plan may run after the layers)."""
        if not getattr(self.config, "hidden_size_per_layer_input", None):
            return ()
        family = self.family
        base, _, _ = family.layers.rpartition(".")
        children = {f"{base}.{name}" if base else name for name, _ in self.model.get_submodule(base).named_children()}
        return tuple(sorted(children - {family.layers, family.final_norm, *family.embeddings}))

    def fit_tensor_parallel(self, ctx: ParallelContext, heads: Heads | None) -> None:
        """Vocab-parallel loss and gathered logits on the adapter; local head counts on HF attention
        when the plan split it per head (`heads`)."""
        if self.family is None:
            return
        model, family = self.model, self.family
        head = model.get_submodule(family.head)
        tp = ctx.group("tp").size
        if not isinstance(head, ColumnParallelLinear):
            raise UserError(f"--tp {tp}: tp plan for {family.model_type} must make {family.head!r} vocab-parallel "
                            "(the loss is computed on vocab shards)")
        if heads is not None:
            _localize_heads(model, heads, tp)
        if head.sequence_parallel:
            self._check_attention_split(tp)
            if getattr(self.config, "hidden_size_per_layer_input", None):  # Gemma3n/Gemma4
                for layer in self._layers():
                    layer.register_forward_pre_hook(_SplitPerLayerInput(ctx), with_kwargs=True)
        if head.sequence_parallel and head.communicate_input and family.final_norm:
            head.communicate_input = False  # the final norm's output arrives gathered instead
            model.get_submodule(family.final_norm).register_forward_hook(_GatherOutput(ctx))
        model.loss_fn = VocabParallelCrossEntropy(  # type: ignore[method-assign]
            head.out_start, head.out_features, ctx.comm, ctx.group("tp"))
        model.full_logits = functools.partial(_gather_vocab, head, ctx)  # type: ignore[method-assign]

    def _check_attention_split(self, tp: int) -> None:
        """Under sequence parallelism a layer's attention sees a sequence shard unless the plan split it
        (its column children gather the sequence): refuse one left whole."""
        assert self.family is not None
        for index, layer in enumerate(self._layers()):
            for name, child in layer.named_children():
                if type(child).__name__.endswith("Attention") and not any(
                        isinstance(m, (ColumnParallelLinear, ReplicatedHeadsLinear)) for m in child.modules()):
                    raise UserError(
                        f"--tp {tp}: sequence parallelism needs every layer's attention split by the tp plan, but "
                        f"{self.family.layers}.{index}.{name} ({type(child).__name__}) is left whole: it would see "
                        "1/tp of the sequence; turn sequence_parallel off")

    def pipeline_blocks(self, loss_fn: LossFn | None, balance: str) -> list[nn.Module]:
        if self.family is None:
            raise UserError(
                f"pipeline parallel is not supported for {self.name}: its config declares no pipeline plan "
                "(base_model_pp_plan) naming its embedding, layers and head (or pass the blocks as an "
                "nn.Sequential with loss_fn)")
        if getattr(self.model, "hf", None) is None and loss_fn is None:
            raise UserError("splitting a bare Hugging Face model needs loss_fn=(output, targets) -> loss, "
                            "or wrap it in ndtrain.models.causal_lm.CausalLM")
        if balance == "measured":
            raise UserError("pipeline balance 'measured' is not supported for Hugging Face models: use 'params'")
        refusal = pipeline_refusal(self.model, self.family)
        if refusal is not None:
            raise UserError(refusal)
        return list(self._layers())

    def end_costs(self) -> tuple[float, float]:
        assert self.family is not None  # pipeline_blocks refused the rest
        return end_costs(self.model, self.family)

    def pipeline_stage(self, block_ids: Sequence[int], first: bool, last: bool, loss_fn: LossFn | None) -> nn.Module:
        assert self.family is not None
        return HFStage(self.model, self.family, block_ids, first=first, last=last, loss_fn=loss_fn)

    def tied_weights(self) -> tuple[str, str] | None:
        if self.family is None or not self.family.tied:
            return None
        head, embedding = next(iter(self.family.tied.items()))
        return embedding, head

    def selective_unit(self, block: nn.Module) -> nn.Module | None:
        return None if self.family is None else block.get_submodule(self.family.attention)

    def decoder_layers(self) -> tuple[str, nn.ModuleList] | None:
        return decoder_layers(self.model)

    @property
    def takes_position_ids(self) -> bool:
        return True

    def context_parallel(self, ring: Ring) -> nn.Module | None:
        return apply_hf_context_parallel(self.model, ring)

    def _layers(self) -> nn.ModuleList:
        return decoder_layers(self.model)[1]  # type: ignore[index]


class _SplitPerLayerInput:
    """Forward pre-hook of a decoder layer taking `per_layer_input` [B, T, p] (second positional, or by
    keyword) computed for the whole sequence from the embedding: cut to this rank's sequence shard, as the
    layer's hidden states are (`SplitSequence`: the gradient all-gathered back)."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.comm, self.group = ctx.comm, ctx.group("tp")

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            return (args[0], SplitSequence.apply(args[1], self.comm, self.group), *args[2:]), kwargs
        if isinstance(kwargs.get("per_layer_input"), torch.Tensor):
            kwargs = {**kwargs, "per_layer_input": SplitSequence.apply(kwargs["per_layer_input"], self.comm, self.group)}
        return args, kwargs


class _GatherOutput:
    """Forward hook: the module's output (a sequence shard) all-gathered to the whole sequence over tp
    (ḡ: the gradient reduce-scattered back)."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.comm, self.group = ctx.comm, ctx.group("tp")

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return GatherSequence.apply(output, self.comm, self.group)


def _localize_heads(model: nn.Module, heads: Heads, tp: int) -> None:
    """Set the head attributes HF attention modules read in their forward to this rank's counts."""
    local_heads = heads.n_heads // tp
    local_kv = heads.n_kv_heads // tp if heads.n_kv_heads % tp == 0 else 1
    local = {"num_key_value_groups": local_heads // local_kv, "num_key_value_heads": local_kv, "num_heads": local_heads,
             "num_attention_heads": local_heads, "split_size": local_heads * heads.head_dim}
    for module in model.modules():
        if isinstance(module, heads.attention_type):
            for name, value in local.items():
                if isinstance(getattr(module, name, None), int):
                    setattr(module, name, value)


def _gather_vocab(head: ColumnParallelLinear, ctx: ParallelContext, logits: torch.Tensor) -> torch.Tensor:
    """Logit shards [..., V'/n] → the real vocabulary [..., V] on every tp rank."""
    return GatherLastDim.apply(logits, ctx.comm, ctx.group("tp"))[..., : head.out_features]


def takes_positions(model: nn.Module, loss_fn: object | None) -> bool:
    """Whether packed documents' per-row positions can reach `model`: without `loss_fn` its own forward
    takes them (the built-in Llama, the CausalLM adapter: models with a `parallel_spec`); with one, the
    forward takes `position_ids=` (a transformers model's family spec)."""
    if loss_fn is None:
        return callable(getattr(model, "parallel_spec", None))
    spec = spec_of(model)
    return spec is not None and spec.takes_position_ids


def spec_of(model: nn.Module) -> ModelParallel | None:
    """The spec of any model the engine is given: the model's own (`parallel_spec()`: the built-in
    Llama, the `CausalLM` adapter), a bare transformers model's family spec, or None."""
    own = getattr(model, "parallel_spec", None)
    if callable(own):
        return own()
    return HFParallel(model) if hf_config(model) is not None else None
