"""The batched per-sample pass: inputs and buffers shared by the samples (NOTE [shared taps])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgram as tg
from reference import assert_oracle_of_the_draw, dense_gramian

B, T, V, D = 4, 5, 7, 3


def _way(f, args, **options):
    report = tg.explain(f, backend="structured", batch_dim=0, run=True, **options)(*args)
    assert report.ran is not None
    return report.ran.way


def _check(f, args):
    expected = dense_gramian(f, args).gramian
    actual = tg.gramian(f, backend="structured", batch_dim=0)(*args).reshape(expected.shape)
    scale = expected.abs().max()
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)


def _params():
    torch.manual_seed(0)
    return {"tok": torch.randn(V, D, dtype=torch.float64),
            "pos": torch.randn(T, D, dtype=torch.float64),
            "w": torch.randn(D, D, dtype=torch.float64),
            "rel": torch.randn(2 * T - 1, D, dtype=torch.float64)}


POSITION_IDS = torch.arange(T)[None]  # a [1, T] buffer, as BERT and GPT-2 keep it


def _encode(p, ids, pos):
    return torch.tanh(F.linear(F.embedding(ids, p["tok"]) + pos, p["w"])).sum((1, 2))


def _shape_checked(pos):
    if pos.dim() != 3 or pos.shape[-1] != D or pos.size(1) != T or len(pos) != 1:
        raise ValueError(f"unexpected position embedding shape {tuple(pos.shape)}")
    return pos


def _relative_bias(p):  # [1, D, T, T] from a [2T - 1, D] table, as Swin builds its bias
    index = (torch.arange(T)[:, None] - torch.arange(T)[None] + T - 1).reshape(-1)
    return F.embedding(index, p["rel"]).view(T, T, -1).permute(2, 0, 1).contiguous().unsqueeze(0)


def _scores(tokens, bias):
    scores = torch.einsum("btd,bsd->bdts", tokens, tokens) + bias
    return (scores.softmax(-1) * scores).sum((1, 2, 3))


def _windows(tokens, bias, *, interleaved):
    scores = torch.einsum("btd,bsd->bdts", tokens, tokens)
    windows = torch.stack([scores, scores.flip(-1)], 1)  # [B, 2, D, T, T]
    if interleaved:
        merged = windows.transpose(0, 1).reshape(-1, D, T, T) + bias
        windows = merged.reshape(2, -1, D, T, T).transpose(0, 1)
    else:
        windows = (windows.reshape(-1, D, T, T) + bias).reshape(-1, 2, D, T, T)
    return (windows.softmax(-1) * windows).sum((1, 2, 3, 4))


def _attended(tokens, bias):
    heads = tokens[:, None].expand(-1, D, -1, -1)  # [B, D, T, D]: D heads
    return F.scaled_dot_product_attention(heads, heads, heads, attn_mask=bias).pow(2).sum(
        (1, 2, 3))


def _met_twice(tokens, pos):
    return ((tokens + pos).tanh() + (2 * tokens + pos).sin()).sum((1, 2))


def _written_after_meeting(tokens, pos):
    hidden = (tokens + pos).tanh()
    pos.mul_(2)
    return (hidden + pos).sum((1, 2))


CASES = {
    # the position embedding [1, T, D] meets the [B, T, D] tokens in `+`: tapped there
    "bert_like": (lambda p, ids: _encode(p, ids, F.embedding(POSITION_IDS, p["pos"])),
                  "batched"),
    # returned unchanged first (as GPT-2's `.to(device)` and dropout in eval mode do)
    "unchanged_first": (lambda p, ids: _encode(p, ids, F.dropout(
        F.embedding(POSITION_IDS, p["pos"]).to(ids.device), 0.1, training=False)), "batched"),
    # only its metadata read first (NOTE [metadata calls]): still pending, tapped at `+`
    "metadata_first": (lambda p, ids: _encode(p, ids, _shape_checked(
        F.embedding(POSITION_IDS, p["pos"]))), "batched"),
    # laid out anew before it meets the batch (indexed, unsqueezed, a Swin-style bias table
    # viewed and permuted): the tap sits on the lookup, the layout calls run per sample
    "indexed_first": (lambda p, ids: _encode(p, ids, F.embedding(POSITION_IDS, p["pos"])[0]),
                      "batched"),
    "unsqueezed_first": (lambda p, ids: _encode(p, ids, F.embedding(torch.arange(T), p["pos"])
                                                .unsqueeze(0)), "batched"),
    "relative_bias": (lambda p, ids: _scores(F.embedding(ids, p["tok"]), _relative_bias(p)),
                      "batched"),
    # ... meeting B·W windows, the samples merged sample-major (Swin), or window-major: the
    # derivative check finds each sample's rows on another's slice, the rows of the batch
    "relative_bias_windows": (lambda p, ids: _windows(F.embedding(ids, p["tok"]),
                                                      _relative_bias(p), interleaved=False),
                              "batched"),
    "relative_bias_windows_interleaved": (lambda p, ids: _windows(
        F.embedding(ids, p["tok"]), _relative_bias(p), interleaved=True), "dense"),
    # ... or passed as the mask of scaled_dot_product_attention, where it meets the scores
    "relative_bias_as_mask": (lambda p, ids: _attended(F.embedding(ids, p["tok"]),
                                                       _relative_bias(p)), "batched"),
    # two views of it meet the batch: the per-sample vmap pass
    "two_views_meet": (lambda p, ids: _met_twice(F.embedding(ids, p["tok"]), (pos := F.embedding(
        torch.arange(T), p["pos"]))[None]) + (pos.unsqueeze(0) * 2).sum(), "vmap"),
    # used by another op before meeting the batch: the per-sample vmap pass instead
    "scaled_first": (lambda p, ids: _encode(p, ids, 2 * F.embedding(POSITION_IDS, p["pos"])),
                     "vmap"),
    # meets the batch twice: both take the one tapped expansion (they ran as called and lost
    # their cotangent: G 0.67 off, session 48)
    "met_twice": (lambda p, ids: _met_twice(F.embedding(ids, p["tok"]),
                                            F.embedding(POSITION_IDS, p["pos"])), "batched"),
    # used by another op after it met the batch (0.81 off): the per-sample pass instead
    "used_after_meeting": (lambda p, ids: _encode(p, ids, pos := F.embedding(POSITION_IDS,
                                                                             p["pos"]))
                           + pos.pow(2).sum(), "vmap"),
    # [T, D] positions of `arange(T)` (nanoGPT's): broadcasting prepends the samples' dim,
    # which the tap merges into the positions (they ran the per-sample vmap pass before)
    "prepended": (lambda p, ids: _met_twice(F.embedding(ids, p["tok"]),
                                            F.embedding(torch.arange(T), p["pos"])), "batched"),
    "prepended_4d": (lambda p, ids: _encode(p, ids[:, None], F.embedding(torch.arange(T),
                                                                            p["pos"])),
                        "batched"),
    # the samples reordered where they meet it: the derivative check finds each sample's rows
    # on another's tap, and the rows of the batch give the matrix
    "prepended_reordered": (lambda p, ids: _met_twice(
        F.embedding(ids, p["tok"]).flip(0), F.embedding(torch.arange(T), p["pos"])), "dense"),
    # written in place before it meets the batch, or after: the tap would sit after the write,
    # the lookup's factors before it (0.07-0.25 off, session 48): the per-sample pass instead
    "scaled_in_place": (lambda p, ids: _encode(p, ids, F.embedding(POSITION_IDS, p["pos"])
                                                .mul_(2)), "vmap"),
    "relu_in_place": (lambda p, ids: _encode(p, ids, F.relu(F.embedding(POSITION_IDS, p["pos"]),
                                                            inplace=True)), "vmap"),
    "written_after_meeting": (lambda p, ids: _written_after_meeting(
        F.embedding(ids, p["tok"]), F.embedding(POSITION_IDS, p["pos"])), "vmap"),
    # returned unchanged by an in-place call that writes nothing: still pending
    "in_place_dropout_in_eval": (lambda p, ids: _encode(p, ids, F.dropout(
        F.embedding(POSITION_IDS, p["pos"]), 0.1, training=False, inplace=True)), "batched"),
    # never meets the batch along a dim of its own: a regulariser added to every loss
    "shared_regulariser": (lambda p, ids: F.embedding(ids, p["tok"]).sum((1, 2))
                           + F.linear(p["pos"], p["w"]).pow(2).sum(), "vmap"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_shared_outputs_are_tapped_where_they_meet_the_batch(name):
    f, way = CASES[name]
    ids = torch.randint(0, V, (B, T))
    args = (_params(), ids)
    assert _way(f, args) == way
    _check(f, args)


def test_several_candidate_dims_are_not_guessed():
    params = _params()

    query = torch.ones(1, 1, D, dtype=torch.float64)

    def f(p, x):  # [1, 1, D] against [B, B, D]: dims 0 and 1 could both be the samples
        return torch.tanh(x + F.linear(query, p["w"])).sum((1, 2))

    args = (params, torch.randn(B, B, D, dtype=torch.float64))
    assert _way(f, args) == "vmap"
    _check(f, args)


def test_a_random_f_whose_samples_interact_after_a_tap_is_not_read_per_sample():
    """Found by the fuzzer: dropout hid the interaction from the check of two samples."""
    params = _params()

    def f(p, x):
        h = torch.tanh(F.linear(x, p["w"]))
        h = h - h.mean(0)  # the samples interact after the tapped layer
        return F.dropout(h, 0.5, training=True).pow(2).sum(-1)

    x = torch.randn(B, D, dtype=torch.float64)
    torch.manual_seed(1)
    expected = dense_gramian(f, (params, x)).gramian
    torch.manual_seed(1)
    report = tg.explain(f, backend="structured", batch_dim=0, run=True)(params, x)
    assert report.ran is not None and report.ran.way == "dense", report.ran
    assert any("derivative" in note for note in report.ran.notes), report.ran.notes
    torch.manual_seed(1)
    actual = tg.gramian(f, backend="structured", batch_dim=0)(params, x)
    assert torch.equal(report.gramian, actual)  # explain's run sees the same draw
    scale = expected.abs().max()
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)


def test_a_random_f_with_independent_samples_stays_batched():
    params = _params()

    def f(p, x):
        return F.dropout(torch.tanh(F.linear(x - x.mean(0), p["w"])), 0.5).pow(2).sum(-1)

    x = torch.randn(B, D, dtype=torch.float64)
    torch.manual_seed(1)
    expected = dense_gramian(f, (params, x)).gramian
    torch.manual_seed(1)
    report = tg.explain(f, backend="structured", batch_dim=0, run=True)(params, x)
    assert report.ran is not None and report.ran.way == "batched", report.ran.notes
    torch.manual_seed(1)
    actual = tg.gramian(f, backend="structured", batch_dim=0)(params, x)
    assert torch.equal(report.gramian, actual)  # explain's run sees the same draw
    scale = expected.abs().max()
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)


def test_later_calls_of_a_random_f_run_no_derivative_check(monkeypatch):
    """NOTE [later calls that draw]: the trace's first call checks, later ones replay."""
    from torchgram.backends.structured import per_sample

    checks: list[int] = []
    real = per_sample._check_derivatives
    monkeypatch.setattr(per_sample, "_check_derivatives",
                        lambda *args: checks.append(1) or real(*args))
    params = _params()

    def f(p, x):
        return F.dropout(torch.tanh(F.linear(x, p["w"])), 0.5).pow(2).sum(-1)

    gramian = tg.gramian(f, backend="structured", batch_dim=0)
    for seed in range(4):
        x = torch.randn(B, D, dtype=torch.float64)
        torch.manual_seed(seed)
        expected = dense_gramian(f, (params, x)).gramian
        torch.manual_seed(seed)
        torch.testing.assert_close(gramian(params, x), expected, rtol=1e-10, atol=1e-12)
    assert len(checks) == 1


@pytest.mark.parametrize("backend", ["structured", "auto"])
@pytest.mark.parametrize("coupling", ["gated-mean", "drawn-flip", "drawn-order"])
def test_a_coupling_that_draws_decide_is_seen_on_every_call(backend, coupling):
    """Draws that open a coupling on some calls only: a per-sample gate (opened in the
    check), a flag broadcast along the samples and a drawn permutation (both in the routing
    digest). Each call is its own draw's Gramian, the first one's gate shut included."""
    params = _params()

    def f(p, x):
        h = torch.tanh(F.linear(x, p["w"]))
        if coupling == "gated-mean":
            h = torch.where(torch.rand(h.shape[0], 1) < 0.3, h - h.mean(0), h)
        elif coupling == "drawn-flip":
            h = torch.where(torch.rand(()) < 0.5, h.flip(0), h)
        else:
            h = h[torch.randperm(h.shape[0])]
        return F.linear(h, p["w"]).pow(2).sum(-1)

    gramian = tg.gramian(f, backend=backend, batch_dim=0)
    for seed in range(6):
        x = torch.randn(B, D, dtype=torch.float64)
        assert_oracle_of_the_draw(f, (params, x), gramian, seed)


@pytest.mark.parametrize("backend", ["structured", "auto"])
@pytest.mark.parametrize("random_f", [False, True], ids=["plain", "with-dropout"])
def test_rows_sorted_by_value_are_checked_again_when_the_order_changes(backend, random_f):
    """``h[x[:, 0].argsort()]``: the rows follow the samples' values. A first call on sorted
    inputs (the identity) passed the derivative check, which then ran once per trace; later
    calls exchanging samples 1 and 2 (the first and the last, run apart, do not see it) were
    0.5-0.7 off (session 28). The check runs again when the routing indices change."""
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 5, dtype=torch.float64),
              "u": torch.randn(5, 2, dtype=torch.float64)}

    def f(p, x):
        h = torch.tanh(x @ p["w"])
        if random_f:  # derivatives checked on every call, cheaply after the first
            h = F.dropout(h, 0.5, training=True)
        return (h @ p["u"])[x[:, 0].argsort()]

    gramian = tg.gramian(f, backend=backend, batch_dim=0)
    for order in ([0, 1, 2, 3, 4, 5], [0, 2, 1, 4, 3, 5], [0, 1, 4, 3, 2, 5]):
        x = torch.randn(6, 3, dtype=torch.float64)
        x = x[x[:, 0].argsort()][order]
        torch.manual_seed(1)
        expected = dense_gramian(f, (params, x)).shaped()
        torch.manual_seed(1)
        actual = gramian(params, x)
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["structured", "auto"])
@pytest.mark.parametrize("kind", ["flag", "mask"])
def test_a_branch_mixing_the_samples_opened_after_the_first_call(backend, kind):
    """``where(flag, h.flip(0), h)``, the flag False on the first call: 0.70-0.92 off later
    (a helper's hunt, session 28); a condition broadcast along the samples counts in the
    routing digest now. A per-sample mask opening ``h - h.mean(0)`` for middle samples later
    was 0.01-0.65 off until session 29: the thorough check runs the selections opened (NOTE
    [opened selections])."""
    torch.manual_seed(1)
    params = {"w": torch.randn(3, 4, dtype=torch.float64),
              "u": torch.randn(4, 2, dtype=torch.float64)}

    def f(p, x, gate):
        h = torch.tanh(x @ p["w"]) @ p["u"]
        h = torch.where(gate, h.flip(0), h) if kind == "flag" else \
            torch.where(gate[:, None], h - h.mean(0), h)
        return h.pow(2).sum(1) + h[:, 0]

    gates = ([torch.tensor(False), torch.tensor(True), torch.tensor(True)] if kind == "flag"
             else [torch.zeros(6, dtype=torch.bool), torch.tensor([0, 1, 1, 0, 0, 0]).bool(),
                   torch.tensor([0, 1, 0, 1, 1, 0]).bool()])
    gramian = tg.gramian(f, backend=backend, batch_dim=0,
                         in_dims=(0, None) if kind == "flag" else 0)
    for gate in gates:
        x = torch.randn(6, 3, dtype=torch.float64)
        expected = dense_gramian(f, (params, x, gate)).shaped()
        torch.testing.assert_close(gramian(params, x, gate), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["structured", "auto"])
def test_the_same_node_kinds_wired_to_mix_samples_after_the_first_call(backend):
    """``s.flip(0).flip(0) * (s * s)`` (per sample), then ``s.flip(0) * (s.flip(0) * s)``
    (row ``b`` mixes samples ``b`` and ``B - 1 - b``): the same node kinds in the same walk
    order, and the first and the last sample run apart give the batch's outputs. Before
    session 40 the thorough derivative check ran once for both (the routing held the kinds,
    not the wiring): 1.0 off, relative, on the second call (NOTE [graph signatures])."""
    torch.manual_seed(2)
    params = {"w": torch.randn(3, 4, dtype=torch.float64),
              "u": torch.randn(4, 2, dtype=torch.float64)}

    def f(p, x, mixed):
        s = (torch.tanh(x @ p["w"]) @ p["u"])[:, 0]
        return s.flip(0) * (s.flip(0) * s) if mixed else s.flip(0).flip(0) * (s * s)

    gramian = tg.gramian(f, backend=backend, batch_dim=0, in_dims=(0, None))
    for mixed in (False, True, False):
        x = torch.randn(6, 3, dtype=torch.float64)
        expected = dense_gramian(f, (params, x, mixed)).shaped()
        torch.testing.assert_close(gramian(params, x, mixed), expected, rtol=1e-10, atol=1e-12)


def test_a_run_that_cannot_be_batched_is_not_tried_again():
    """NOTE [runs that cannot be batched]: a shared output used by ``torch.where`` before it
    meets the batch (T5's relative position bias) stops the batched run; later calls of the
    trace go per sample at once (one evaluation of the whole batch fewer), and ``auto`` knows."""
    params = _params()
    ids = torch.randint(0, V, (B, T))
    full_batch = []

    def f(p, ids):
        full_batch.append(ids.shape[0] == B)
        bias = F.embedding(torch.arange(T), p["pos"])  # shared by the samples
        bias = torch.where(bias > 0, bias, bias * 0.5)  # used before it meets the batch
        return (F.embedding(ids, p["tok"]) + bias).tanh().sum((-1, -2))

    _check(f, (params, ids))
    full_batch.clear()
    assert _way(f, (params, ids)) != "batched"
    assert sum(full_batch) == 2, full_batch  # the batch's outputs and one check (3 before)
    _check(f, (params, ids))
