"""Zero-bubble's split backward: the input gradient now (I), the weight gradients later (W).

I runs `autograd.grad(output, [input])`, which skips every weight product, while prehooks on the
*boundary* nodes of the graph (an operation with an activation input and a parameter input, e.g.
a matmul with a weight or a multiply by a norm weight) keep the gradient flowing into them.
W then restarts autograd at each boundary node with that gradient, restricted to the parameters
beneath it: only the weight halves of those operations run. Memory between I and W: the graph
(kept with retain_graph) plus one output gradient per boundary node, about one layer's worth of
activations per weight matrix. When the graph does not split cleanly (a parameter under two
boundary nodes, or a boundary node I did not reach), W re-walks the whole graph instead.

W is one autograd call per boundary node: one call over all of them would also send each
node's input gradient down to the boundary nodes beneath it (their weights are reachable that
way), counting those weights twice. So a data-parallel wrapper that synchronises at the end of a
backward must see the calls of one W as one backward (the runner's `weight_pass`), and
`before(params)` lets a wrapper that shards its parameters (ZeRO-3) gather them first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.graph import GradientEdge, Node


def _post_order(root: Node) -> list[Node]:
    """Every node reachable from `root`, each after all the nodes it feeds gradients into."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in seen)
    return order


class WeightPasses:
    """Install on a stage output before its input-gradient pass; `run()` is the weight pass."""

    def __init__(self, output: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        self.boundary: dict[Node, list[torch.nn.Parameter]] = {}
        self._handles = []
        self.complete = output.grad_fn is not None
        if not self.complete:
            return
        by_id = {id(p): p for p in params}
        param_only: dict[Node, bool] = {}
        below: dict[Node, list[torch.nn.Parameter]] = {}
        for node in _post_order(output.grad_fn):
            variable = getattr(node, "variable", None)
            children = [c for c, _ in node.next_functions if c is not None]
            if variable is not None:  # AccumulateGrad of a leaf
                param_only[node] = id(variable) in by_id
                below[node] = [by_id[id(variable)]] if param_only[node] else []
                continue
            param_only[node] = bool(children) and all(param_only[c] for c in children)
            below[node] = [p for c in children if param_only[c] for p in below[c]]
            if not param_only[node] and below[node]:
                self.boundary[node] = below[node]
        covered = [id(p) for ps in self.boundary.values() for p in ps]
        self.complete = sorted(covered) == sorted(by_id) and len(set(covered)) == len(covered)
        if self.complete:
            self._handles = [node.register_prehook(self._capture(node)) for node in self.boundary]

    def _capture(self, node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            self.captured[node] = grad_outputs

        return hook

    def input_pass_done(self) -> None:
        """Remove the hooks; the split holds if I reached every boundary node."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.complete = self.complete and len(self.captured) == len(self.boundary)

    def run(self, before: Callable[[list[torch.nn.Parameter]], None] | None = None) -> None:
        """The weight gradients, accumulated into `.grad` (one accumulation per parameter), boundary
        node by boundary node in forward order; `before(params)` runs ahead of each node's call."""
        for node, params in self.boundary.items():
            grads = self.captured.pop(node)
            if before is not None:
                before(params)
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=params)
