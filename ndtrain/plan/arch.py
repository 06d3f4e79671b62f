"""Model specs for the planner: exact parameter counts and FLOPs per token of GPT and Llama decoders.

Symbols: l layers, h hidden, a query heads, k key/value heads, d = h/a head size, f FFN width,
V vocabulary, s sequence length.

Parameters (exact, as the reference implementations build them):

    gpt   (Radford 2019 / Brown 2020: LayerNorm with bias, biases on every linear, GeLU MLP,
          learned positions, output head tied to the embedding)
          per layer  h·(a+2k)·d + (a+2k)·d  [qkv]  +  a·d·h + h  [proj]  +  2·h·f + f + h  [mlp]  +  4h  [2 LN]
          = 12h² + 13h when k = a and f = 4h;  total  l·(12h² + 13h) + V·h + s·h + 2h
    llama (Touvron 2023: RMSNorm, no biases, SwiGLU, rotary positions, untied output head)
          per layer  h·(a+2k)·d + a·d·h  [attention]  +  3·h·f  [w1, w2, w3]  +  2h  [norms]
          total  l·(per layer) + 2·V·h + h

Beyond the two families (all optional, so a spec without them counts exactly as above):
    head_size   d when it is not h/a (Gemma, Qwen3: the attention's width a·d differs from h)
    tied        the output head is the embedding (None: the family's practice, gpt tied, llama not)
    learned_positions   an s×h position table (None: the family's practice, gpt has one)
    extra_layer_params   per-layer parameters neither formula has (attention biases of Qwen2, Q/K
                norms of Qwen3), counted in memory, not in FLOPs
    hf          transformers' own modules run the layers (`--model hf:DIR`): memory counts what their
                eager layers and an `hf:` worker process hold (`memory.py`, `cpu_profile.py`)
    moe         a mixture-of-experts MLP (`moe.py`): parameters held (every expert: weights, gradients,
                optimizer state) differ from those a token uses (k experts + shared: FLOPs); per-layer
                figures of a model whose layers differ (dense layers first) are means over its layers,
                the stage sums (`layers_params`) are exact

Dropout, by arch unless `dropout` says otherwise: gpt has it (Megatron's GPT practice, 0.1 on the
hidden states and the attention probabilities), llama has none; it decides the element-wise work of
a kernel profile (`kernels.py`: the masks' bytes), not the FLOPs.

Attention kernel, by arch unless `flash` says otherwise (the practice of each family's published runs):
    gpt    Megatron's dense masked softmax (Shoeybi 2019): QKᵀ and AV over the full s×s score
           matrix, which is stored for the backward (Korthikanti 2022's 5·a·s²·b)
    llama  FlashAttention (Dao 2022), causal: half the score FLOPs are skipped, no score matrix
           is stored, and the backward recomputes the scores itself (so "selective" recompute
           is what it always does)

Forward FLOPs per token (Narayanan 2021, §5.1, generalised to GQA, any f and causal kernels):
    per layer  2·W  +  c·4·s·a·d      W = weights of the layer's matrices; 4·s·a·d = QKᵀ and AV
                                      over the full score matrix; c = 1 dense, 1/2 causal flash
    logits     2·h·V
A training step costs 3× the forward (backward = 2× forward). For GPT with f = 4h this gives
Narayanan's 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) per batch of B sequences (96·… with full
recompute, which adds one more forward of the layers but not of the logits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from ndtrain.config import MODEL_PRESETS
from ndtrain.errors import UserError
from ndtrain.plan.moe import Experts

ARCHS = ("gpt", "llama")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    flash: bool | None = None  # attention kernel: None = the family's practice (see above)
    dropout: bool | None = None  # dropout layers: None = the family's practice (see above)
    head_size: int | None = None  # d: None = h/a
    tied: bool | None = None  # output head = embedding: None = the family's practice (gpt tied)
    extra_layer_params: int = 0  # per-layer parameters the family's formula lacks (biases, Q/K norms)
    moe: Experts | None = None  # a mixture-of-experts MLP (None: dense, width ffn)
    learned_positions: bool | None = None  # an s×h position table: None = the family's practice (gpt)
    hf: bool = False  # run by transformers' modules in ndtrain's workers (`--model hf:DIR`), not ndtrain's Block

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise UserError(f"--arch {self.arch!r} is unknown: choose one of {', '.join(ARCHS)}")
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            if getattr(self, field) <= 0:
                raise UserError(f"model {field}={getattr(self, field)} must be > 0")
        if self.moe is not None and self.arch != "llama":
            raise UserError(f"{self.name}: mixtures of experts are modelled with gated (llama-style) MLPs only")
        if self.head_size is not None and self.head_size <= 0:
            raise UserError(f"model head_size={self.head_size} must be > 0")
        if self.head_size is None and self.hidden % self.heads:
            raise UserError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}: change one of them")
        if self.heads % self.kv_heads:
            raise UserError(f"--heads {self.heads} is not divisible by --kv-heads {self.kv_heads}: change one of them")

    @cached_property
    def head_dim(self) -> int:
        return self.hidden // self.heads if self.head_size is None else self.head_size

    @cached_property
    def tied_embeddings(self) -> bool:
        return self.arch == "gpt" if self.tied is None else self.tied

    @cached_property
    def kv_ratio(self) -> float:
        """k/a: the size of K (or V) relative to Q."""
        return self.kv_heads / self.heads

    @cached_property
    def attention_weights(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h

    @cached_property
    def layer_matrix_weights(self) -> int | float:
        """W: weights of one layer's matrices a token multiplies by (the FLOP-carrying parameters);
        with experts, the mean over the layers of the attention + the k experts, shared ones and router."""
        if self.moe is None:
            return self.attention_weights + (2 if self.arch == "gpt" else 3) * self.hidden * self.ffn
        dense = self.layers - self.moe.moe_layers(self.layers)
        mlp = dense * 3 * self.hidden * self.ffn + self.moe.moe_layers(self.layers) * self.moe.active_params(self.hidden)
        return self.attention_weights + mlp / self.layers

    def params_of_layer(self, index: int) -> int:
        """Parameters layer `index` holds (every expert of a MoE layer)."""
        h, d = self.hidden, self.head_dim
        if self.arch == "gpt":
            biases = (self.heads + 2 * self.kv_heads) * d + h + self.ffn + h
            return self.attention_weights + 2 * h * self.ffn + biases + 4 * h + self.extra_layer_params
        if self.moe is None or self.moe.is_dense(index):
            mlp = 3 * h * self.ffn
        else:
            mlp = self.moe.held_params(h)
        return self.attention_weights + mlp + 2 * h + self.extra_layer_params

    @cached_property
    def layer_params(self) -> int | float:
        """Parameters of one layer; with experts, the mean over the layers (sums: `layers_params`)."""
        if self.moe is None:
            return self.params_of_layer(0)
        return self.layers_params(0, self.layers) / self.layers

    def layers_params(self, start: int, count: int) -> int:
        """Parameters of the `count` layers from `start` (a pipeline stage's)."""
        if self.moe is None:
            return count * self.params_of_layer(0)
        return sum(self.params_of_layer(i) for i in range(start, start + count))

    @cached_property
    def largest_layer_params(self) -> int:
        return max(self.params_of_layer(i) for i in range(self.layers)) if self.moe else self.params_of_layer(0)

    @cached_property
    def token_ffn(self) -> int | float:
        """The MLP width one token's activations span: f dense; k·f_e + f_s with experts (mean over layers)."""
        if self.moe is None:
            return self.ffn
        moe_layers = self.moe.moe_layers(self.layers)
        return ((self.layers - moe_layers) * self.ffn + moe_layers * self.moe.token_width) / self.layers

    @cached_property
    def expert_params(self) -> int:
        """The routed experts' parameters over all layers (0 for a dense model)."""
        return self.moe.moe_layers(self.layers) * self.moe.routed_params(self.hidden) if self.moe else 0

    @cached_property
    def active_params(self) -> int:
        """Parameters one token uses: all but the experts it is not routed to."""
        if self.moe is None:
            return self.total_params
        unused = (self.moe.count - self.moe.top_k) * 3 * self.hidden * self.moe.ffn
        return self.total_params - self.moe.moe_layers(self.layers) * unused

    @cached_property
    def embedding_params(self) -> int:
        """Input side: token embedding (+ learned positions: gpt unless told otherwise)."""
        learned = self.arch == "gpt" if self.learned_positions is None else self.learned_positions
        positions = self.seq * self.hidden if learned else 0
        return self.vocab * self.hidden + positions

    @cached_property
    def head_params(self) -> int:
        """Output side: final norm (+ the output matrix unless tied to the embedding)."""
        norm = 2 * self.hidden if self.arch == "gpt" else self.hidden
        return norm if self.tied_embeddings else norm + self.vocab * self.hidden

    @cached_property
    def output_matrix_params(self) -> int:
        """V·h: the output projection, a copy of the embedding on the last stage when tied."""
        return self.vocab * self.hidden

    @cached_property
    def total_params(self) -> int:
        return self.layers_params(0, self.layers) + self.embedding_params + self.head_params

    @cached_property
    def layer_forward_flops_per_token(self) -> int | float:
        return 2 * self.layer_matrix_weights + self.attention_forward_flops_per_token

    @cached_property
    def flash_attention(self) -> bool:
        """Causal FlashAttention rather than a stored dense score matrix: llama unless told otherwise."""
        return self.arch == "llama" if self.flash is None else self.flash

    @cached_property
    def has_dropout(self) -> bool:
        return self.arch == "gpt" if self.dropout is None else self.dropout

    @cached_property
    def attention_forward_flops_per_token(self) -> int:
        """c·4·s·a·d: QKᵀ and AV (what selective recompute repeats); c = 1/2 for causal flash."""
        full = 4 * self.seq * self.heads * self.head_dim
        return full // 2 if self.flash_attention else full

    @cached_property
    def logits_forward_flops_per_token(self) -> int:
        return 2 * self.hidden * self.vocab

    @cached_property
    def model_flops_per_token(self) -> int:
        """Forward + backward = 3× forward, no recompute: the FLOPs MFU is defined on."""
        forward = self.layers * self.layer_forward_flops_per_token + self.logits_forward_flops_per_token
        return 3 * forward


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 50257, seq: int = 2048) -> ModelSpec:
    return ModelSpec(name, "gpt", layers, hidden, heads, heads, 4 * hidden, vocab, seq)


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int) -> ModelSpec:
    return ModelSpec(name, "llama", layers, hidden, heads, kv, ffn, vocab, seq)


def _mixtral(name: str, layers: int, hidden: int, heads: int, ffn: int, vocab: int) -> ModelSpec:
    return ModelSpec(name, "llama", layers, hidden, heads, 8, ffn, vocab, 4096, moe=Experts(8, 2, ffn))


def _ndtrain(name: str) -> ModelSpec:
    p = MODEL_PRESETS[name]
    return _llama(f"ndtrain-{name}", p["n_layers"], p["dim"], p["n_heads"], p["n_kv_heads"], p["ffn_dim"], 256,
                  p["seq_len"])


# GPT-3 sizes: Brown et al. 2020, Table 2.1, with two of its inconsistencies resolved by head size 128:
# 1.3B lists 24 heads for d = 2048 (16 heads of 128), 13B lists d = 5140 (5120 = 40 heads of 128).
# Llama 2: Touvron et al. 2023 and the released configs; Llama 3: Llama Team 2024, Table 3.
# Mixtral: Jiang et al. 2024 ("Mixtral of Experts", Table 1: 8 experts, 2 per token, 8 kv heads; 46.7 B
# parameters, 12.9 B active) and the released mistralai/Mixtral-8x7B-v0.1 and -8x22B-v0.1 config.json
# files; trained at 4096 tokens here (Megatron-Core's Mixtral 8x7B training recipe), not their 32k/64k windows.
PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _gpt("gpt3-125m", 12, 768, 12),
        _gpt("gpt3-350m", 24, 1024, 16),
        _gpt("gpt3-760m", 24, 1536, 16),
        _gpt("gpt3-1.3b", 24, 2048, 16),
        _gpt("gpt3-2.7b", 32, 2560, 32),
        _gpt("gpt3-6.7b", 32, 4096, 32),
        _gpt("gpt3-13b", 40, 5120, 40),
        _gpt("gpt3-175b", 96, 12288, 96),
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
        _mixtral("mixtral-8x7b", 32, 4096, 32, 14336, 32000),
        _mixtral("mixtral-8x22b", 56, 6144, 48, 16384, 32768),
        *(_ndtrain(name) for name in MODEL_PRESETS),
    )
}


def preset(name: str, seq: int | None = None) -> ModelSpec:
    if name not in PRESETS:
        raise UserError(f"--model {name!r} is unknown: choose one of {', '.join(PRESETS)} or give --arch and its sizes")
    spec = PRESETS[name]
    if seq is None:
        return spec
    return dataclasses.replace(spec, seq=seq)


def explicit(arch: str, layers: int | None, hidden: int | None, heads: int | None, kv_heads: int | None,
             ffn: int | None, vocab: int | None, seq: int | None) -> ModelSpec:
    """A model from `--arch gpt|llama --layers --hidden --heads [--kv-heads] [--ffn] --vocab --seq`."""
    given = {"--layers": layers, "--hidden": hidden, "--heads": heads, "--vocab": vocab, "--seq": seq}
    missing = [flag for flag, value in given.items() if value is None]
    if missing:
        raise UserError(f"--arch {arch} needs {', '.join(missing)} too (or use --model PRESET)")
    assert layers and hidden and heads and vocab and seq
    default_ffn = 4 * hidden if arch == "gpt" else _llama_ffn(hidden)
    return ModelSpec(f"{arch}-custom", arch, layers, hidden, heads, kv_heads or heads, ffn or default_ffn, vocab, seq)


def _llama_ffn(hidden: int, multiple: int = 256) -> int:
    """Llama's default SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256 (11008 for h = 4096)."""
    width = int(2 * 4 * hidden / 3)
    return multiple * ((width + multiple - 1) // multiple)
