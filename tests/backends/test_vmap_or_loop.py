"""NOTE [vmap or loop], NOTE [vmap failures remembered]: loops where ``vmap`` cannot batch ``f``."""

from __future__ import annotations

import pytest
import torch

import torchgram as tg
from custom_functions import SquareWithoutVmap
from reference import dense_gramian


def _unbatchable_by_vmap(p, x):
    return torch.tanh(SquareWithoutVmap.apply(x @ p["w"])).sum(-1)


def _args():
    torch.manual_seed(0)
    return {"w": torch.randn(3, 2, dtype=torch.float64)}, torch.randn(6, 3, dtype=torch.float64)


def _notes(backend, f, args, **options):
    return tg.explain(f, backend=backend, batch_dim=0, run=True, **options)(*args).ran.notes


@pytest.mark.parametrize("backend", ["jacobian", "ntvp"])
def test_a_failure_is_remembered_for_the_call_signature(backend):
    params, x = _args()

    def f(p, x):
        return _unbatchable_by_vmap(p, x)

    first = _notes(backend, f, (params, x))
    assert any("redone with loops" in note for note in first), first
    later = _notes(backend, f, (params, x))
    assert any("vmap failed on this call signature before" in note for note in later), later
    G = tg.gramian(f, backend=backend, batch_dim=0)(params, x)
    torch.testing.assert_close(G, dense_gramian(f, (params, x)).gramian)


def test_auto_ranks_again_when_its_choice_fails_under_vmap():
    """Under a memory budget only the jacobian backend fits: its vmap fails, auto ranks the
    candidates again with the loops' cost (the jacobian backend still the only one that
    fits: it loops), and the next call knows."""
    params, x = _args()

    def f(p, x):
        return _unbatchable_by_vmap(p, x)

    report = tg.explain(f, batch_dim=0, memory_budget=1, run=True)(params, x)
    assert report.auto_choice == "jacobian" and report.ran.backend == "jacobian"
    assert any("candidates ranked again with its loops' cost" in note
               for note in report.ran.notes), report.ran.notes
    torch.testing.assert_close(report.gramian, dense_gramian(f, (params, x)).gramian)
    again = tg.explain(f, batch_dim=0, memory_budget=1, run=True)(params, x)
    assert any("vmap failed on this call signature before" in note
               for note in again.ran.notes), again.ran.notes
    assert again.estimates["jacobian"].time > report.estimates["jacobian"].time  # its loops


def test_auto_kernel_ranks_again_when_its_choice_fails_under_vmap():
    params, x = _args()

    def f(p, x):
        return _unbatchable_by_vmap(p, x)

    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), memory_budget=1)
    kernel = ntk_fn(x, x[:2], params)
    expected = dense_gramian(f, (params, torch.cat([x, x[:2]]))).gramian[:6, 6:]
    torch.testing.assert_close(kernel, expected)
    notes = [note for report in ntk_fn.last_run.reports for note in report.notes]
    assert any("candidates ranked again with its loops' cost" in note for note in notes), notes


def test_the_structured_fallback_remembers_that_vmap_fails():
    """A leaf no rule covers goes per sample under vmap; ``f`` reading the batch's values makes
    that vmap fail, and the loop runs. Later calls loop at once (before session 64 each call
    tried vmap first, and failed)."""
    params, x = _args()
    params["power"] = torch.rand(3, dtype=torch.float64) + 0.5
    under_vmap = []

    def f(p, x):
        under_vmap.append(torch._C._functorch.is_batchedtensor(x))
        if torch.isnan(x).any():
            raise ValueError("NaN in the batch")
        return torch.tanh((x.abs() + 1) ** p["power"] @ p["w"]).sum(-1)

    report = tg.explain(f, backend="structured", batch_dim=0, run=True)(params, x)
    assert report.fallback == ("power",) and any(under_vmap)
    under_vmap.clear()
    G = tg.gramian(f, backend="structured", batch_dim=0)(params, x)
    assert not any(under_vmap)
    torch.testing.assert_close(G, dense_gramian(f, (params, x)).gramian)


def test_a_torchgram_call_inside_f_loops_for_itself_under_auto():
    """auto makes its candidates decline at a vmap failure; a torchgram call inside ``f`` (its
    own per-sample norms) decides for itself: it loops, and ``f`` never sees the signal (the
    first review of session 64: the inner call raised it into ``f``)."""
    params, x = _args()
    raised = []

    def norms(p, x):
        try:
            return tg.gramian(_unbatchable_by_vmap, batch_dim=0, diagonal=True,
                              backend="jacobian")(p, x)
        except Exception as error:
            raised.append(type(error).__name__)
            raise

    report = tg.explain(norms, batch_dim=0, run=True)(params, x)
    assert "VmapFailed" not in raised
    assert not any("fails on a batch of one" in note for note in report.ran.notes)
