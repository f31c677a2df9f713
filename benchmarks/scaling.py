"""Scaling: does the per-sample Gramian cost grow the way its math does?

``python benchmarks/scaling.py [--quick] [--threads 1] [--rounds 7] [--out DIR]``

The MLP 784-512-512-10 of ``cases.py`` over ``B ∈ {16, 64, 256, 1024}`` and its transformer
(d=128, 2 layers, B=32) over ``T ∈ {16, 64, 256}``, each for the full Gramian and for
``diagonal=True``, per-sample cross-entropy losses, 1 torch thread. Per point, in alternated
turns (medians):

* ``backward``: ``losses.sum().backward()`` on the module;
* ``torchgram``: ``tg.gramian(f, batch_dim=0, diagonal=...)`` (backend auto);
* ``hand-written``: the best hand-written contraction of the same math: one forward with the
  parameters as constants, one backward to the layer outputs, then per layer the cheaper (in
  multiply-adds) of the ghost form ``(X Xᵀ) ⊙ (Γ Γᵀ)`` summed over positions and the
  per-sample gradients ``Σ_t x_t ⊗ γ_t`` and their Gram; biases and norm scales from the
  same cotangents (``(X Xᵀ + 1) ⊙ (Γ Γᵀ)`` for a linear layer without positions); embedding
  tables from their rows. No planning, no checks, no tracing.

Next to the times: the cost model's estimate for the structured backend (its contractions,
and ``F·(1 + R)`` for the passes, NOTE [auto cost model]) and the forward's multiply-adds.
Writes ``scaling.md`` and ``scaling.json`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import torchgram as tg  # noqa: E402
from benchmarks import cases  # noqa: E402
from benchmarks.measure import alternated_medians, set_threads  # noqa: E402
from benchmarks.run import _commit, _cpu, _load  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
Call = Callable[[], Any]


# -- the hand-written contractions ------------------------------------------------------------

def _linear_block(acts: Tensor, cots: Tensor, diagonal: bool) -> Tensor:
    """A weight's block from ``acts [B, T, a]`` and ``cots [B, T, c]``: the cheaper way."""
    b, t, a = acts.shape
    c = cots.shape[-1]
    if t == 1:
        acts, cots = acts[:, 0], cots[:, 0]
        if diagonal:
            return (acts * acts).sum(1) * (cots * cots).sum(1)
        return (acts @ acts.T) * (cots @ cots.T)
    pairs = b if diagonal else b * b
    if pairs * t * t * (a + c + 1) < b * t * a * c + pairs * a * c:  # ghost
        if diagonal:
            return (torch.einsum("bta,bua->btu", acts, acts)
                    * torch.einsum("btc,buc->btu", cots, cots)).sum((1, 2))
        x = acts.reshape(b * t, a)
        g = cots.reshape(b * t, c)
        return ((x @ x.T) * (g @ g.T)).reshape(b, t, b, t).sum((1, 3))
    jac = torch.bmm(cots.transpose(1, 2), acts).reshape(b, -1)  # per-sample gradients
    return (jac * jac).sum(1) if diagonal else jac @ jac.T


def _vector_block(vectors: Tensor, diagonal: bool) -> Tensor:
    """The block of per-sample gradients ``[B, P]``."""
    flat = vectors.reshape(vectors.shape[0], -1)
    return (flat * flat).sum(1) if diagonal else flat @ flat.T


def mlp_handwritten(model: nn.Sequential, x: Tensor, y: Tensor, diagonal: bool) -> Tensor:
    """``Σ_l (X_l X_lᵀ + 1) ⊙ (Γ_l Γ_lᵀ)`` from one forward and one backward to the outputs."""
    acts, outs, h = [], [], x
    for module in model:
        if isinstance(module, nn.Linear):
            acts.append(h)
            h = F.linear(h, module.weight.detach(), module.bias.detach())
            if not h.requires_grad:
                h.requires_grad_()
            outs.append(h)
        else:
            h = module(h)
    grads = torch.autograd.grad(F.cross_entropy(h, y, reduction="none").sum(), outs)
    total: Tensor | None = None
    for a, g in zip(acts, grads, strict=True):
        if diagonal:
            block = ((a * a).sum(1) + 1) * (g * g).sum(1)
        else:
            block = (a @ a.T + 1) * (g @ g.T)
        total = block if total is None else total + block
    assert total is not None
    return total


def _layer_norm(x: Tensor, norm: nn.LayerNorm, taps: list[Tensor],
                scales: list[tuple[Tensor, int]]) -> Tensor:
    normed = F.layer_norm(x, norm.normalized_shape, eps=norm.eps)
    out = normed * norm.weight.detach() + norm.bias.detach()
    scales.append((normed, len(taps)))
    taps.append(out)
    return out


def transformer_handwritten(model: nn.Module, tokens: Tensor, y: Tensor,
                            diagonal: bool) -> Tensor:
    """The same math for ``cases._Encoder``: every weight, bias, norm scale and table."""
    b, t = tokens.shape
    taps: list[Tensor] = []
    linears: list[tuple[Tensor, int]] = []  # (activation, tap index)
    scales: list[tuple[Tensor, int]] = []  # (normalised input, tap index)

    def linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        out = F.linear(x, weight.detach(), bias.detach())
        linears.append((x, len(taps)))
        taps.append(out)
        return out

    token_rows = model.tokens.weight.detach()[tokens].requires_grad_()
    position_rows = model.positions.weight.detach()[:t].expand(b, t, -1).requires_grad_()
    h = token_rows + position_rows
    for layer in model.encoder.layers:
        attention = layer.self_attn
        heads, d = attention.num_heads, h.shape[-1]
        qkv = linear(h, attention.in_proj_weight, attention.in_proj_bias)
        q, k, v = (part.reshape(b, t, heads, d // heads).transpose(1, 2)
                   for part in qkv.chunk(3, dim=-1))
        merged = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        h = _layer_norm(h + linear(merged, attention.out_proj.weight, attention.out_proj.bias),
                        layer.norm1, taps, scales)
        hidden = torch.relu(linear(h, layer.linear1.weight, layer.linear1.bias))
        h = _layer_norm(h + linear(hidden, layer.linear2.weight, layer.linear2.bias),
                        layer.norm2, taps, scales)
    logits = linear(h.mean(1, keepdim=True), model.head.weight, model.head.bias)[:, 0]
    grads = torch.autograd.grad(F.cross_entropy(logits, y, reduction="none").sum(),
                                [token_rows, position_rows, *taps])
    token_grad, position_grad, tap_grads = grads[0], grads[1], grads[2:]
    table = token_grad.new_zeros(b, model.tokens.num_embeddings, token_grad.shape[-1])
    table.scatter_add_(1, tokens[..., None].expand_as(token_grad), token_grad)
    total = _vector_block(table, diagonal) + _vector_block(position_grad, diagonal)
    for x, index in linears:
        g = tap_grads[index]
        total = total + _linear_block(x, g, diagonal) + _vector_block(g.sum(1), diagonal)
    for normed, index in scales:
        g = tap_grads[index]
        total = total + _vector_block((normed * g).sum(1), diagonal) + \
            _vector_block(g.sum(1), diagonal)
    return total


# -- the points -------------------------------------------------------------------------------

def _point(name: str, sizes: cases.Sizes, diagonal: bool) -> dict[str, Any]:
    case = cases.build(name, sizes)
    case.module.eval()  # the encoder's math kernel path; dropout is 0 anyway
    model, params = case.module, list(case.module.parameters())

    def backward() -> None:
        for p in params:
            p.grad = None
        case.rows(model, *case.inputs).sum().backward()

    transform = tg.gramian(case.f, batch_dim=0, diagonal=diagonal)
    handwritten = mlp_handwritten if name == "mlp" else transformer_handwritten
    calls: dict[str, Call] = {
        "backward": backward,
        "torchgram": lambda: transform(case.params, *case.inputs),
        "hand-written": lambda: handwritten(model, *case.inputs, diagonal),
    }
    expected = calls["hand-written"]().double()
    actual = calls["torchgram"]().detach().double().reshape(expected.shape)
    error = float((actual - expected).norm() / expected.norm())
    explanation = tg.explain(case.f, batch_dim=0, diagonal=diagonal)(case.params, *case.inputs)
    contraction = sum(leaf.cost for leaf in explanation.leaves)
    return {"calls": calls, "error": error, "estimate": explanation.estimates["structured"].time,
            "contraction_estimate": contraction, "forward_flops": explanation.forward_flops,
            "backend": explanation.backend}


GRID = {"mlp": ("mlp_batch", (16, 64, 256, 1024)), "transformer": ("tf_len", (16, 64, 256))}
QUICK_GRID = {"mlp": ("mlp_batch", (4, 8)), "transformer": ("tf_len", (4, 8))}


def run(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure every point; write ``scaling.md`` and ``scaling.json``; return the rows."""
    parser = argparse.ArgumentParser(description="Per-sample Gramian cost against batch size "
                                                 "and sequence length.")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    base = cases.QUICK if args.quick else cases.FULL
    grid = QUICK_GRID if args.quick else GRID
    rounds = args.rounds or (1 if args.quick else 7)
    out = args.out or (Path(tempfile.gettempdir()) / "torchgram-scaling-quick" if args.quick
                       else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    threads_before = torch.get_num_threads()
    set_threads(args.threads)
    load_before, start = _load(), time.perf_counter()
    rows = []
    try:
        for name, (knob, values) in grid.items():
            for value in values:
                for diagonal in (False, True):
                    sizes = cases.Sizes(**{**base.__dict__, knob: value})
                    point = _point(name, sizes, diagonal)
                    times = alternated_medians(point.pop("calls"), rounds, warmups=2)
                    row = {"case": name, knob: value, "diagonal": diagonal, **times, **point}
                    rows.append(row)
                    print(f"{name:11s} {knob}={value:<5d} diagonal={diagonal!s:5s} "
                          f"backward {times['backward'] * 1e3:8.2f} ms, torchgram "
                          f"{times['torchgram'] / times['backward']:5.2f}×, hand-written "
                          f"{times['hand-written'] / times['backward']:5.2f}×, torchgram / "
                          f"hand-written {times['torchgram'] / times['hand-written']:5.2f} "
                          f"(rel. error {point['error']:.0e})", flush=True)
    finally:
        torch.set_num_threads(threads_before)
    env = {"command": "python benchmarks/scaling.py" + "".join(f" {a}" for a in argv),
           "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
           "commit": _commit(), "torch": torch.__version__, "cpu": _cpu(),
           "threads": args.threads, "rounds": rounds, "load_before": load_before,
           "load_after": _load(), "wall_s": time.perf_counter() - start}
    (out / "scaling.md").write_text(markdown(rows, env))
    (out / "scaling.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    print(f"wrote {out / 'scaling.md'} in {env['wall_s']:.0f} s")
    return rows


def markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The results page."""
    lines = [
        "# Scaling of the per-sample Gramian", "",
        f"`{env['command']}` — {env['date']}, {env['commit']}, torch {env['torch']}, "
        f"{env['cpu']}, {env['threads']} torch thread(s), {env['rounds']} alternated rounds, "
        f"load average {env['load_before']} before / {env['load_after']} after, "
        f"{env['wall_s']:.0f} s.", "",
        "Medians; ratios to the plain backward of the same point. *hand-written*: one forward "
        "and one backward to the layer outputs, then each layer's cheaper contraction, in "
        "plain torch (module docstring). Estimates: the cost model's multiply-adds for the "
        "structured backend's contractions and its whole call, and the forward's.", "",
        "| case | size | G | backward (ms) | torchgram | hand-written | torchgram / hand-written "
        "| est. contractions | est. total | forward | rel. error |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        size = f"B={row['mlp_batch']}" if "mlp_batch" in row else f"T={row['tf_len']}"
        floor = row["backward"]
        lines.append(
            f"| {row['case']} | {size} | {'diag' if row['diagonal'] else 'full'} | "
            f"{floor * 1e3:.2f} | {row['torchgram'] / floor:.2f}× | "
            f"{row['hand-written'] / floor:.2f}× | "
            f"{row['torchgram'] / row['hand-written']:.2f} | {row['contraction_estimate']:.2g} | "
            f"{row['estimate']:.2g} | {row['forward_flops']:.2g} | {row['error']:.0e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run()
