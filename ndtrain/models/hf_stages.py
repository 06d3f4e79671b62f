"""Pipeline stages cut from a Hugging Face causal LM by its family record (declared `base_model_pp_plan`, or
GPT-2's hand-written one): each stage runs the model's own forward code over its own layers only.

What a stage holds: some consecutive decoder layers of the family's layer list; the first stage also
the token embedding (GPT-2: + the learned position embedding), the last stage the final norm and the
head. Parameters keep their names in the whole model (`hf.model.layers.3.self_attn.q_proj.weight`):
each part sits at its own dotted path inside the stage, the layers in a dict keyed by their global
index, so checkpoints and `full_state_dict` see the original names. The base model's parameter-free
children (rotary tables, dropouts) are shared by every stage of the rank.

How a stage runs: it calls the family's own forward (the base model's, and on the last stage the
`*ForCausalLM`'s) on a shell of it, built per call, whose layer list holds this stage's layers at their
global indices and, elsewhere, stand-ins: before the stage's first layer one that returns the incoming
activation (what the previous stage sent), after its last layer one that ends the forward there with
the hidden states it is given. Whatever the family's forward computes for its layers is therefore
computed as in the whole model, with nothing repeated here: per-layer attention masks chosen by the
layer's global index into `config.layer_types` (Gemma2/3, Qwen2 with sliding windows) or by
`config.sliding_window` (Mistral), the rotary tables per layer type (Gemma3's `rotary_emb(x, position_ids,
layer_type)`), the scaled embedding and GPT-NeoX's `emb_dropout` (first stage), and the head's
post-processing of the logits (last stage: Gemma2's `final_logit_softcapping`, Cohere's `logit_scale`,
Granite's `logits_scaling`). A stage after the first gives the forward an all-zero, never-materialised
`inputs_embeds` of the activation's shape (what the prologue reads is its shape, dtype and device; what it
computes from its values is replaced by the incoming activation before the stage's first layer).

Refused in one line (`pipeline_refusal`, checked by the launcher and by the spec before the cut): a base model or
`*ForCausalLM` holding parameters outside the plan's parts (embedding, layers, final norm, head) — a
module the plan does not place in any stage, whose output may feed every layer (Gemma4's per-layer
embeddings, DeepSeek-V4's hyper-connection head).

The loss: the Engine's `loss_fn(output, targets)` on what the unsplit model returns for tokens
(the adapter's `full_logits(logits)`, or for a bare `*ForCausalLM` a `CausalLMOutputWithPast`
holding the logits), else the adapter's own `loss_fn(logits, targets)` (a tensor-parallel
vocab-parallel loss included). Communication: none here (the runner moves [b, T, d] activations).
Cost: one shell (two dicts) per call; the family's prologue (masks, rotary tables) runs on every stage.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ndtrain.models.hf_documents import ring_documents
from ndtrain.models.hf_families import Family, hf_config, hf_model

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` at dotted `path` under `root`, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if not hasattr(node, name):
            node.add_module(name, nn.Module())
        node = getattr(node, name)
    node.add_module(leaf, module)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def end_costs(model: nn.Module, family: Family) -> tuple[float, float]:
    """Parameter counts of the first stage's extras (embeddings) and the last stage's (norm, head)."""
    def count(names: Sequence[str]) -> float:
        return float(sum(p.numel() for n in names if n for p in model.get_submodule(n).parameters()))

    return count(family.embeddings), count((family.final_norm, family.head))


def model_parts(family: Family) -> tuple[str, str, str]:
    """(the `*ForCausalLM`'s path, the base model's path, the layer list's name in the base model)."""
    base, _, layers = family.layers.rpartition(".")
    causal = family.head.rpartition(".")[0]
    return causal, base, layers


def pipeline_refusal(model: nn.Module, family: Family) -> str | None:
    """Why `model` cannot be cut into stages (the start of a one-line message), or None: parameters that
    its base model or `*ForCausalLM` holds outside the family's embedding, layers, final norm and head."""
    causal_path, base_path, _ = model_parts(family)
    placed = {*family.embeddings, family.embed_dropout, family.layers, family.final_norm, family.head}
    outside = []
    for path in (causal_path, base_path):
        owner = model.get_submodule(path)
        outside += [f"{path}.{name}".lstrip(".") for name, _ in owner.named_parameters(recurse=False)]
        outside += [f"{path}.{name}".lstrip(".") for name, child in owner.named_children()
                    if f"{path}.{name}".lstrip(".") not in placed | {base_path} and _has_parameters(child)]
    if not outside:
        return None
    return (f"pipeline parallel is not supported for model_type {family.model_type!r}: "
            f"{', '.join(repr(name) for name in outside)} {'holds' if len(outside) == 1 else 'hold'} parameters "
            "outside its pipeline plan (embedding, layers, final norm, head), so no stage can run it")


class StageEnd(Exception):
    """Raised by the stand-in after a stage's last layer: carries the hidden states it was given."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage boundary")
        self.hidden = hidden


class Incoming(nn.Module):
    """Stand-in for a layer before the stage's first: returns the activation the previous stage sent."""

    def __init__(self, activation: torch.Tensor) -> None:
        super().__init__()
        self.activation = activation

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.activation


class End(nn.Module):
    """Stand-in for a layer after the stage's last: ends the forward with the hidden states it is given."""

    def __init__(self, input_name: str) -> None:
        super().__init__()
        self.input_name = input_name

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise StageEnd(args[0] if args else kwargs[self.input_name])


class _Absent(nn.Module):
    """Stand-in for a part another stage holds that the family's forward calls whatever its input (GPT-2's
    position embedding on later stages): a zero scalar, added to values the stage then discards."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(())


def shell(module: nn.Module, children: dict[str, nn.Module], training: bool) -> nn.Module:
    """`module`'s object with other children: its forward runs on them (attributes, config, hooks shared)."""
    copy = object.__new__(type(module))
    copy.__dict__.update(module.__dict__)
    copy.__dict__["_modules"] = children
    copy.__dict__["training"] = training
    return copy


class HFStage(nn.Module):
    """Decoder layers `layer_ids` of an HF causal LM with its embeddings (first) and norm, head, loss (last)."""

    def __init__(self, model: nn.Module, family: Family, layer_ids: Sequence[int], first: bool, last: bool,
                 loss_fn: LossFn | None) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.config = hf_config(model)
        self._family = family
        self._layer_ids = list(layer_ids)
        causal_path, base_path, self._list_name = model_parts(family)
        layers = model.get_submodule(family.layers)
        self._n_layers = len(layers)
        _place(self, family.layers, nn.ModuleDict({str(i): layers[i] for i in layer_ids}))
        owned = [*(family.embeddings if first else ()), *((family.final_norm, family.head) if last else ())]
        for name in owned:
            if name:
                _place(self, name, model.get_submodule(name))
        base = model.get_submodule(base_path)
        self._base_children: dict[str, str | None] = {}  # child name → path in this stage (None: absent here)
        for name, child in base.named_children():
            path = f"{base_path}.{name}".lstrip(".")
            if name == self._list_name:
                continue
            if path not in owned and not _has_parameters(child):
                _place(self, path, child)  # rotary tables, dropouts: every stage runs them
            self._base_children[name] = path if path in owned or not _has_parameters(child) else None
        causal = model.get_submodule(causal_path)
        head_name = family.head[len(causal_path) + 1:] if causal_path else family.head
        self._causal_children: dict[str, str] = {}  # child name → path in this stage ("": the base model)
        for name, child in causal.named_children():
            path = f"{causal_path}.{name}".lstrip(".")
            if child is base or name == head_name:
                self._causal_children[name] = "" if child is base else path
            elif not _has_parameters(child):
                _place(self, path, child)
                self._causal_children[name] = path
        self._templates = (shell(base, {}, False), shell(causal, {}, False))  # no reference to other stages' parts
        self._options = {"output_router_logits": False} if getattr(self.config, "output_router_logits", False) else {}
        if last:
            self._engine_loss = loss_fn
            self.loss_fn = getattr(model, "loss_fn", None)  # the adapter's seam (tp may have replaced it)
            self._full_logits = getattr(model, "full_logits", None)
            self._adapter = hf_model(model) is not model
        self.tied = None  # set by split_model: the name of this stage's copy of a tied embedding/head

    def _base_shell(self, activation: torch.Tensor | None) -> nn.Module:
        """The base model running this stage's layers, stand-ins for the others."""
        first_id, last_id = self._layer_ids[0], self._layer_ids[-1]
        layers = []
        for i in range(self._n_layers):
            if first_id <= i <= last_id:
                layers.append(self.get_submodule(f"{self._family.layers}.{i}"))
            elif i < first_id:
                assert activation is not None
                layers.append(Incoming(activation))
            else:
                layers.append(End(self._family.layer_input))
        children: dict[str, nn.Module] = {self._list_name: nn.ModuleList(layers)}
        for name, path in self._base_children.items():
            children[name] = self.get_submodule(path) if path is not None else _Absent()
        return shell(self._templates[0], children, self.training)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tokens (first stage) or the activation [B, T or a sequence shard, d] → activation, or on the
        last stage the loss (the logits without targets). The sequence length is the targets' when
        given (under tensor parallel's sequence parallelism activations are sequence shards);
        `positions` [T/cp] are a context-parallel shard's global positions (default 0..T−1), [B, T] (or a
        cp shard of them) per-row positions of packed documents, which attention keeps apart."""
        seq = (x if targets is None else targets).shape[1]
        positions = torch.arange(seq, device=x.device) if positions is None else positions
        shared = positions.ndim == 1
        position_ids = positions.unsqueeze(0) if shared else positions
        if self.first:
            inputs: dict[str, Any] = {"input_ids": x}
        else:  # the prologue reads its shape, dtype and device; the stand-ins replace what it computes
            inputs = {"inputs_embeds": x.new_zeros(()).expand(x.shape[0], seq, x.shape[-1])}
        call = {**inputs, "position_ids": position_ids, "use_cache": False, **self._options,
                **ring_documents(self.config, position_ids, shared)}
        base = self._base_shell(None if self.first else x)
        if not self.last:
            try:
                base(**call)
            except StageEnd as end:
                return end.hidden
            raise RuntimeError(f"{self._family.model_type}'s forward did not reach decoder layer {self._layer_ids[-1] + 1}")
        children = {name: self.get_submodule(path) if path else base for name, path in self._causal_children.items()}
        causal = shell(self._templates[1], children, self.training)
        return self._loss(causal(**call).logits, targets)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        if targets is None or self._engine_loss is not None:
            output: Any = self._full_logits(logits) if self._full_logits is not None else logits
            if not self._adapter:
                from transformers.modeling_outputs import CausalLMOutputWithPast

                output = CausalLMOutputWithPast(logits=output)
            return output if targets is None else self._engine_loss(output, targets)
        return self.loss_fn(logits, targets)
