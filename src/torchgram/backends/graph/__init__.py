"""``backend="graph"``: Gramians by walking an autograd graph (DESIGN.md §2).

``nodes`` calls one autograd node on row-batched cotangents, ``walk`` pushes row-Jacobians
through a graph in topological order, ``gramian`` forms each input's block from them (shared
with the imperative API ``torchgram.autograd.gramian``), ``release`` frees a walked graph,
and ``backend`` is the functional front: it runs ``f`` once and walks the graph it recorded.
"""

from torchgram.backends.graph.backend import graph_backend
from torchgram.backends.graph.gramian import graph_gramian, plan_graph
from torchgram.backends.graph.release import release_graph

__all__ = ["graph_backend", "graph_gramian", "plan_graph", "release_graph"]
