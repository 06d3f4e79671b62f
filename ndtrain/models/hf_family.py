"""The record of where a Hugging Face causal LM's parts are (module names) and how tensor parallel splits it.

Filled from what transformers declares for the family (hf_declared.py) or, for a family that
declares nothing, by hand (hf_families.FAMILIES); read by the family's spec (hf_parallel.py), its
pipeline stages (hf_stages.py) and context parallel (hf_context.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    """Module names (relative to the `*ForCausalLM`) of one family's parts, and its tp support."""

    model_type: str
    embeddings: tuple[str, ...]     # token embedding first, then any others (GPT-2's positions)
    layers: str                     # the decoder-layer nn.ModuleList
    final_norm: str
    head: str
    attention: str                  # the attention module inside one layer
    kv_projections: tuple[str, ...] = ()  # children of `attention` projecting keys and values
    tied: dict[str, str] = field(default_factory=dict)  # head weight → embedding weight when tie_word_embeddings
    layer_input: str = "hidden_states"  # keyword name of a layer's / attention's input when not positional
    tp_plan: dict[str, str] | None = None  # module pattern → style (tp_plan.py); None: tp refused
    tp_refusal: str = ""            # why tp is refused, when it is
    # how the model prepares a layer's inputs (pipeline stages repeat it per stage):
    rotary: str | None = None       # the rotary module giving position_embeddings=(cos, sin) (Llama/Qwen2)
    positions: str | None = None    # the learned position embedding added to the tokens' (GPT-2's wpe)
    embed_dropout: str | None = None  # the dropout applied to the embeddings (GPT-2's drop)
