"""Property-based fuzzing of every backend against the dense float64 oracle.

Random architectures and calls (``fuzz_strategies.cases``) must give the oracle's matrix or a
torchgram error, and leave nothing behind (``fuzz_check.check``). The ``fast`` profile (the
default) runs a fixed set of examples per backend; ``TORCHGRAM_FUZZ_PROFILE=long`` runs
thousands (see ``fuzz_strategies``). A failure hypothesis shrinks becomes a named test in
``test_regressions.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_aggregate import check_aggregated, check_eager_update
from fuzz_check import check, check_eager
from fuzz_compose import MODES, check_composed
from fuzz_kernels import check_kernel, kernel_cases
from fuzz_strategies import cases, profile
from fuzz_threads import check_concurrently

# dynamo warns while tracing the compiled linear form (``opaque_code.compiled_linear``) on a
# weight that is not a leaf (the oracle's plain calls compile it; torchgram's run it eagerly)
pytestmark = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")

BACKENDS = ["jacobian", "ntvp", "graph", "structured", "auto"]
THREAD_EXAMPLES = 6
"""The fast profile's examples of the concurrency property (three calls each, made thrice)."""


@pytest.mark.parametrize("backend", BACKENDS)
@profile()
@given(data=st.data())
def test_oracle_or_torchgram_error(backend: str, data: st.DataObject) -> None:
    """Activations may run in place here: where torch refuses the oracle, a torchgram error."""
    check(data.draw(cases(backend, in_place=True), label="case"), backend)


@pytest.mark.parametrize("recorded", [True, False], ids=["record", "walk"])
@profile()
@given(data=st.data())
def test_eager_oracle_or_torchgram_error(recorded: bool, data: st.DataObject) -> None:
    """``tg.autograd.gramian`` on the graph of an eager call (issue 15), recorded and walked."""
    check_eager(data.draw(cases("graph"), label="case"), recorded)


@pytest.mark.parametrize("backend", ["auto", "structured", "jacobian", "ntvp"])
@profile()
@given(data=st.data())
def test_kernel_oracle_or_torchgram_error(backend: str, data: st.DataObject) -> None:
    """``tg.ntk.empirical_ntk_fn`` cross kernels (issue 11): the oracle's or a torchgram error."""
    check_kernel(data.draw(kernel_cases(backend), label="kernel"), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@profile()
@given(data=st.data())
def test_aggregated_update_oracle_or_torchgram_error(backend: str, data: st.DataObject) -> None:
    """``tg.aggregated_grad``'s update ``Jᵀ w(G)`` (issue 16): the oracle's or a torchgram error."""
    check_aggregated(data.draw(cases(backend), label="case"), backend)


@pytest.mark.parametrize("recorded", [True, False], ids=["record", "walk"])
@profile()
@given(data=st.data())
def test_eager_update_oracle_or_torchgram_error(recorded: bool, data: st.DataObject) -> None:
    """``tg.autograd.backward``'s ``.grad`` (``Jᵀ w(G)``, issues 15 and 16), recorded and walked."""
    check_eager_update(data.draw(cases("graph"), label="case"), recorded)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
@profile()
@given(data=st.data())
def test_composed_oracle_or_torchgram_error(backend: str, mode: str, data: st.DataObject) -> None:
    """grad, jvp, vmap and eager create-graph *through* ``tg.gramian``: the same transform of
    the dense oracle's function, or a torchgram error (``fuzz_compose``)."""
    check_composed(data.draw(cases(backend), label="case"), backend, mode)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
@profile(examples=THREAD_EXAMPLES)
@given(data=st.data())
def test_concurrent_calls_give_what_they_give_alone(backend: str, data: st.DataObject) -> None:
    """Three generated calls made alone, then all again from several threads at once, each
    twice: the oracle's answers and the same refusals (``fuzz_threads``)."""
    check_concurrently([data.draw(cases(backend), label=f"case {i}") for i in range(3)],
                       backend)
