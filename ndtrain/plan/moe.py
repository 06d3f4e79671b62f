"""A mixture-of-experts MLP for the planner: `Experts`, its parameters held vs its parameters used per token.

Symbols: h hidden, E routed experts, k experts per token, f_e one routed expert's width, f_s the
shared experts' total width (0: none), f the dense MLP width of the layers that have no experts.

Parameters of one MoE layer's MLP (gated experts, as Mixtral, Qwen2/3-MoE, DeepSeek-style MoE build them):
    held     E·3·h·f_e  [every routed expert: gate, up, down]  +  3·h·f_s  [shared]  +  E·h  [router]
             +  h  [Qwen2-MoE's sigmoid gate on the shared expert, when present]
    per token (FLOPs)  k·3·h·f_e + 3·h·f_s + E·h (+ h): the router scores every expert, k of them run
Memory (weights, gradients, optimizer state) is paid on what is held; FLOPs on what each token uses.
A layer listed in `dense_layers` has a dense gated MLP of width f instead (3·h·f both ways).

Under tensor parallelism ndtrain splits every expert's matrices over the tp ranks (parallel/model/moe.py:
gate/up by columns, down by rows) and keeps the router whole: held expert and shared weights take 1/t,
the router E·h (and the shared gate) does not. The planner divides the whole layer by t, as for every
other layer: the router's (t−1)/t·E·h per layer it leaves out is below 1/(3·f_e) of the experts.

Activations of one MoE layer per token, in values (the experts run on gathered copies of their tokens):
k·h for the copies of the token sent to its experts and k·h for their outputs before weighting
(replicated over tp), 3·(k·f_e + f_s) for the experts' gate, up and product (split over tp), and
2·E for the router's logits and probabilities (replicated). No capacity factor or token dropping:
ndtrain's experts run every routed token.

Cost: arithmetic on a handful of integers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.errors import UserError


@dataclass(frozen=True)
class Experts:
    count: int  # E routed experts per MoE layer
    top_k: int  # k experts per token
    ffn: int  # f_e: one routed expert's width
    shared_ffn: int = 0  # f_s: the shared experts' total width (0: none)
    shared_gate: bool = False  # a sigmoid gate h → 1 on the shared experts' output (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # indices of the layers whose MLP is dense (width f), not experts

    def __post_init__(self) -> None:
        for field in ("count", "top_k", "ffn"):
            if getattr(self, field) <= 0:
                raise UserError(f"mixture of experts: {field}={getattr(self, field)} must be > 0")
        if self.top_k > self.count:
            raise UserError(f"mixture of experts: {self.top_k} experts per token of {self.count}: fix the config")
        if self.shared_ffn < 0:
            raise UserError(f"mixture of experts: shared expert width {self.shared_ffn} must be ≥ 0")

    def is_dense(self, layer: int) -> bool:
        return layer in self.dense_layers

    def moe_layers(self, layers: int) -> int:
        return layers - sum(1 for i in self.dense_layers if i < layers)

    def held_params(self, hidden: int) -> int:
        """Parameters of one MoE layer's MLP: every expert, the shared ones, the router (and shared gate)."""
        return self.count * 3 * hidden * self.ffn + self.common_params(hidden)

    def active_params(self, hidden: int) -> int:
        """Parameters one token's forward multiplies by in one MoE layer: its k experts, the shared ones, the router."""
        return self.top_k * 3 * hidden * self.ffn + self.common_params(hidden)

    def routed_params(self, hidden: int) -> int:
        """The routed experts' parameters of one MoE layer (the "expert memory" of a layer)."""
        return self.count * 3 * hidden * self.ffn

    def common_params(self, hidden: int) -> int:
        """What every token uses: the shared experts, the router and the shared gate."""
        return 3 * hidden * self.shared_ffn + self.count * hidden + (hidden if self.shared_gate else 0)

    @property
    def token_width(self) -> int:
        """k·f_e + f_s: the MLP width one token's activations span (the dense equivalent of f)."""
        return self.top_k * self.ffn + self.shared_ffn

    def replicated_values(self, hidden: int) -> float:
        """Activations per token and per h replicated over tp: k copies in, k outputs, 2E router values."""
        return 2 * self.top_k + 2 * self.count / hidden
