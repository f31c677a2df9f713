"""``backend="structured"``: Gramians from layer structure (DESIGN.md §1), a fallback per leaf.

``trace`` runs ``f`` under a ``TorchFunctionMode`` that finds and taps the calls the
``rules`` recognise, ``passes`` runs the tapped forward and the backwards for the rows'
cotangents, ``cost`` chooses per leaf between the ghost, materialized and sparse forms,
``contraction`` forms the blocks, and ``backend`` ties them together; ``cross`` computes
kernels between two input sets from each side's factors (NOTE [structured cross kernels]).
"""

from torchgram.backends.structured.backend import (
    StructuredPlan,
    plan_problem,
    run_structured,
    structured_backend,
)
from torchgram.backends.structured.cross import structured_cross

__all__ = ["StructuredPlan", "plan_problem", "run_structured", "structured_backend",
           "structured_cross"]
