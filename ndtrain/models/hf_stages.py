"""Pipeline stages cut from a Hugging Face causal LM (Llama, Qwen2, GPT-2 families), by its family spec.

What a stage holds: some consecutive decoder layers of the family's layer list; the first stage
also the token embedding (GPT-2: + the learned position embedding and the embedding dropout), the
last stage the final norm, the head and the loss. Parameters keep their names in the whole model
(`hf.model.layers.3.self_attn.q_proj.weight`): each part sits at its own dotted path inside the
stage, the layers in a dict keyed by their index, so checkpoints and `full_state_dict` see the
original names. A parameter-free rotary module (Llama/Qwen2's `rotary_emb`) is shared by every
stage of the rank, each computing cos/sin for the positions 0..T−1 from the activation it gets.

How a layer is called: as the model itself does (transformers 5): the hidden states first, then
`attention_mask=` the mask `create_causal_mask` (or the sliding-window variant for a layer whose
`config.layer_types` entry says so) builds from the config (None with SDPA: `is_causal`),
`position_ids=` [1, T], and for RoPE families `position_embeddings=(cos, sin)`.

The loss: the Engine's `loss_fn(output, targets)` on what the unsplit model returns for tokens
(the adapter's `full_logits(logits)`, or for a bare `*ForCausalLM` a `CausalLMOutputWithPast`
holding the logits), else the adapter's own `loss_fn(logits, targets)` (a tensor-parallel
vocab-parallel loss included). Communication: none here (the runner moves [b, T, d] activations).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ndtrain.models.hf_families import Family, hf_config

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


def end_costs(model: nn.Module, family: Family) -> tuple[float, float]:
    """Parameter counts of the first stage's extras (embeddings) and the last stage's (norm, head)."""
    def count(names: Sequence[str]) -> float:
        return float(sum(p.numel() for n in names for p in model.get_submodule(n).parameters()))

    return count(family.embeddings), count((family.final_norm, family.head))


class HFStage(nn.Module):
    """Decoder layers `layer_ids` of an HF causal LM with its embeddings (first) and norm, head, loss (last)."""

    def __init__(self, model: nn.Module, family: Family, layer_ids: Sequence[int], first: bool, last: bool,
                 loss_fn: LossFn | None) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.config = hf_config(model)
        self._family = family
        self._layer_names = [f"{family.layers}.{i}" for i in layer_ids]
        layers = model.get_submodule(family.layers)
        _place(self, family.layers, nn.ModuleDict({str(i): layers[i] for i in layer_ids}))
        self._layer_types = [self._layer_type(i) for i in layer_ids]
        if family.rotary is not None:
            _place(self, family.rotary, model.get_submodule(family.rotary))
        if first:
            for name in (*family.embeddings, family.embed_dropout):
                if name is not None:
                    _place(self, name, model.get_submodule(name))
        if last:
            for name in (family.final_norm, family.head):
                _place(self, name, model.get_submodule(name))
            self._engine_loss = loss_fn
            self._loss_fn = getattr(model, "loss_fn", None)        # the adapter's (tp may have replaced it)
            self._full_logits = getattr(model, "full_logits", None)
            self._adapter = getattr(model, "hf", None) is not None
        self.tied = None  # set by split_model: the name of this stage's copy of a tied embedding/head

    def _layer_type(self, index: int) -> str:
        types = getattr(self.config, "layer_types", None)
        return types[index] if types else "full_attention"

    def _masks(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        """The attention mask per layer type, as the whole model builds them (`hidden`: [B, T, any])."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {
            kind: builders[kind](config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None,
                                 position_ids=position_ids)
            for kind in set(self._layer_types)
        }

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tokens (first stage) or the activation [B, T or a sequence shard, d] → activation, or on the
        last stage the loss (the logits without targets). The sequence length is the targets' when
        given (under tensor parallel's sequence parallelism activations are sequence shards);
        `positions` [T/cp] are a context-parallel shard's global positions (default 0..T−1)."""
        family = self._family
        seq = (x if targets is None else targets).shape[1]
        position_ids = (torch.arange(seq, device=x.device) if positions is None else positions).unsqueeze(0)
        if self.first:
            x = self.get_submodule(family.embeddings[0])(x)
            if family.positions is not None:
                x = x + self.get_submodule(family.positions)(position_ids).to(x.device)
            if family.embed_dropout is not None:
                x = self.get_submodule(family.embed_dropout)(x)
        extra: dict[str, Any] = {}
        if family.rotary is not None:
            extra["position_embeddings"] = self.get_submodule(family.rotary)(x, position_ids)
        masks = self._masks(x.new_empty(x.shape[0], seq, 0), position_ids)  # the mask reads only shape, dtype, device
        for name, kind in zip(self._layer_names, self._layer_types):
            x = self.get_submodule(name)(x, attention_mask=masks[kind], position_ids=position_ids, **extra)
        return self._head(x, targets) if self.last else x

    def _head(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        logits = self.get_submodule(self._family.head)(self.get_submodule(self._family.final_norm)(x))
        if targets is None or self._engine_loss is not None:
            output: Any = self._full_logits(logits) if self._full_logits is not None else logits
            if not self._adapter:
                from transformers.modeling_outputs import CausalLMOutputWithPast

                output = CausalLMOutputWithPast(logits=output)
            return output if targets is None else self._engine_loss(output, targets)
        return self._loss_fn(logits, targets)
