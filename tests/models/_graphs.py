"""What ``torch.compile`` cut a module into, for tests of which ops share a graph."""

from __future__ import annotations

from typing import Any

import torch


class GraphRecorder:
    """A ``torch.compile`` backend that runs each graph as traced and keeps, in order, the set of ops it calls
    (``graphs``), so a test sees where the graph breaks fell."""

    def __init__(self) -> None:
        self.graphs: list[set[str]] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        self.graphs.append(
            {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"}
        )
        return gm.forward

    def with_op(self, name: str) -> list[set[str]]:
        """The graphs that call ``name``, in order."""
        return [ops for ops in self.graphs if name in ops]
