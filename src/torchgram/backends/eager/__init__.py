"""The imperative Gramian of eager code: recorded layers contracted, the rest walked.

``record`` runs a forward under a ``TorchFunctionMode`` that notes the calls the structured
rules recognise (NOTE [eager recording]); ``graph_index`` finds them again in the graph;
``samples`` locates the samples in their outputs (NOTE [sample layouts]), ``shared`` where an
output shared by the samples meets them (NOTE [eager shared taps]); ``passes`` gets the
cotangents there (NOTE [eager taps]); ``gramian`` contracts them with the structured
backend's machinery and walks the graph for everything else (NOTE [imperative Gramian]).
"""

from torchgram.backends.eager.gramian import EagerResult, eager_gramian
from torchgram.backends.eager.record import Recording, current_recording, record

__all__ = ["EagerResult", "Recording", "current_recording", "eager_gramian", "record"]
