"""Recorded calls whose output is shared by every sample: read where it meets the batch.

# NOTE [eager shared taps]
A recorded call whose output ``y`` does not depend on the sample has no sample layout
(NOTE [sample layouts]): BERT's and GPT-2's position embeddings, looked up with ``[1, T]``
id buffers, are ``[1, T, d]``. A backward seeded for every sample sums their cotangents at
``y``, which is not any sample's own. But such an output is *broadcast* into the batch
where it meets it, ``z = x + y`` (``[B, T, d]``), and there every sample has its own slice:
under the promise of ``batch_dim``, sample ``b``'s cotangent at ``z`` lives on its slice,
so its cotangent at ``y`` is that slice times ``∂z/∂y`` (``scale``, and ``x`` for
``z = x ⊙ y``), summed over the dims along which ``y`` was broadcast (besides the samples'
one). The recording notes every broadcast of a recorded output by ``+`` / ``-`` / ``*`` /
``expand`` (an :class:`~torchgram.backends.eager.record.EagerMeeting`, with ``x`` kept as
the activations are: a version change drops the meeting); the Gramian uses one when

* the output has no sample layout of its own (the probes say so, or its shape);
* ``z``'s node is the **only** consumer of ``y`` in the graph (so the chain rule through
  that one op is all of ``∂out/∂y``: any other use, e.g. a second add, leaves the call to
  the walk as before); ops that return ``y`` itself (``y.to(y.device)``, eval dropout) make
  no node and are no use;
* ``z`` has a sample layout along a dim where ``y`` has size 1 (candidates and probes as
  for any tap: if a probe's cotangent at ``z`` spreads, the samples interact and the rows
  are those of the whole batch, exactly).

The call's activations (the ``[1, T]`` ids) are then the same for every sample: they are
expanded over the samples, and the contraction sees one per-sample use as for any tap.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from torchgram._core import _torch_compat
from torchgram.backends.eager.graph_index import GraphIndex
from torchgram.backends.eager.record import EagerMeeting, Recording
from torchgram.backends.eager.samples import SampleLayout, candidates
from torchgram.backends.graph.nodes import Edge


def meeting_options(meeting: EagerMeeting, y_shape: Sequence[int],
                    samples: int) -> list[SampleLayout]:
    """``z``'s candidate layouts along the dims where ``y`` was broadcast (size 1 or absent)."""
    offset = len(meeting.shape) - len(y_shape)
    dims = [d for d in range(len(meeting.shape))
            if d < offset or y_shape[d - offset] == 1]
    return candidates(meeting.shape, samples, dims)


def sole_meetings(recording: Recording, graph: GraphIndex, outputs: Sequence[Tensor],
                  slots: dict[int, Edge]) -> dict[int, tuple[EagerMeeting, Edge]]:
    """Per tap (of ``slots``), its meeting whose ``z`` is ``y``'s only consumer in the graph.

    ``slots`` are the taps' slots (their outputs' nodes and numbers); the graph below
    ``outputs`` is walked once, counting every edge into those slots.
    """
    met: dict[int, list[tuple[EagerMeeting, Edge]]] = {}
    for meeting in recording.meetings:
        if meeting.tap not in slots:
            continue
        node = graph.node(meeting.seq, meeting.node_name, recording)
        if node is not None:
            met.setdefault(meeting.tap, []).append((meeting, (node, meeting.output_nr)))
    if not met:
        return {}
    consumers = _consumers(outputs, {slots[tap] for tap in met})
    found = {}
    for tap, options in met.items():
        users = consumers.get(slots[tap], [])
        for meeting, slot in options:
            if len(users) == 1 and users[0] is slot[0]:
                found[tap] = (meeting, slot)
                break
    return found


def _consumers(outputs: Sequence[Tensor], targets: set[Edge]) -> dict[Edge, list[object]]:
    """Every node below ``outputs`` with an edge into one of ``targets``, once per edge."""
    found: dict[Edge, list[object]] = {}
    stack = []
    for out in outputs:
        edge = _torch_compat.gradient_edge(out)
        if (edge.node, edge.output_nr) in targets:  # an output itself: seeded there too
            found.setdefault((edge.node, edge.output_nr), []).append(out)
        stack.append(edge.node)
    seen: set[object] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if _torch_compat.is_leaf_accumulator(node):
            continue
        for child, nr in node.next_functions:
            if child is None:
                continue
            if (child, nr) in targets:
                found.setdefault((child, nr), []).append(node)
            if child not in seen:
                stack.append(child)
    return found
