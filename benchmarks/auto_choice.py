"""Does ``auto`` pick the fastest backend? Small real models, every backend side by side.

``python benchmarks/auto_choice.py [--models bert,t5] [--rounds 5] [--threads 1] [--out DIR]``

Per-sample Gramians (``batch_dim=0``) of small real models -- the models of
:mod:`benchmarks.real_cases` at :data:`SMALL` sizes (hidden 16, 8 tokens, batch 8), and four
``transformers`` models whose structured pass goes per sample (T5's relative position bias
meets the mask in ``torch.where``; Mixtral's router, Gemma's and ConvBERT's layers that no
rule covers), all float32 -- are timed with ``backend="auto"`` and with each backend, in
alternated rounds in one process (round ``r`` calls every method once, the order reversed
every other round; medians), after two warm-up calls each (``auto`` learns on its first
calls what the trace cannot see: NOTE [vmap failures remembered], NOTE [runs that cannot be
batched]). It reports ``auto ÷ best``: ``auto``'s time over the fastest backend's, the
backend ``auto`` ran (``tg.explain(..., run=True)`` after the timed rounds), and each
backend's agreement with the fastest one's answer. Writes ``auto_choice.{md,json}`` to
``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

import torchgram as tg  # noqa: E402
from benchmarks import real_cases  # noqa: E402
from benchmarks.measure import set_threads  # noqa: E402
from benchmarks.run import _commit, _cpu, _load  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BACKENDS = ("structured", "graph", "jacobian", "ntvp")
SMALL = real_cases.Sizes(batch=8, tokens=8, hidden=16, layers=2, heads=2, vocab=100,
                         classes=10, vit_image=16, vit_patch=4, swin_image=16, swin_window=4,
                         resnet_image=16, resnet_width=8, mobilenet_image=32,
                         mobilenet_width=0.5, rnn_embed=16, rnn_hidden=32)
"""Small sizes, where per-call costs and loops decide between the backends."""


def _lm(name: str, config: Any, model_class: type, s: real_cases.Sizes) -> real_cases.RealCase:
    model = model_class(config).eval()
    ids, mask = real_cases._padded(s)

    def rows(model: Callable[..., Any], ids: Tensor, *, attention_mask: Tensor) -> Tensor:
        return real_cases._lm_losses(model, ids, attention_mask=attention_mask)

    return real_cases.RealCase(name, f"{type(model).__name__}, small", model, (ids,), rows,
                               {"attention_mask": mask})


def _t5(s: real_cases.Sizes) -> real_cases.RealCase:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=s.vocab, d_model=s.hidden, d_kv=s.hidden // s.heads,
                      d_ff=4 * s.hidden, num_layers=s.layers, num_decoder_layers=s.layers,
                      num_heads=s.heads, dropout_rate=0.0, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).eval()
    ids, mask = real_cases._padded(s)
    targets = torch.randint(1, s.vocab, (s.batch, 4))

    def rows(model: Callable[..., Any], ids: Tensor, targets: Tensor, *,
             attention_mask: Tensor) -> Tensor:
        logits = model(input_ids=ids, attention_mask=attention_mask, labels=targets).logits
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)

    return real_cases.RealCase("t5", "T5ForConditionalGeneration, small", model,
                               (ids, targets), rows, {"attention_mask": mask})


def _decoder_config(config_class: type, s: real_cases.Sizes, **extra: Any) -> Any:
    return config_class(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=4 * s.hidden,
                        num_hidden_layers=s.layers, num_attention_heads=s.heads,
                        num_key_value_heads=s.heads, head_dim=s.hidden // s.heads,
                        max_position_embeddings=4 * s.tokens, **extra)


def _mixtral(s: real_cases.Sizes) -> real_cases.RealCase:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = _decoder_config(MixtralConfig, s, num_local_experts=3, num_experts_per_tok=2)
    return _lm("mixtral", config, MixtralForCausalLM, s)


def _gemma(s: real_cases.Sizes) -> real_cases.RealCase:
    from transformers import GemmaConfig, GemmaForCausalLM

    return _lm("gemma", _decoder_config(GemmaConfig, s), GemmaForCausalLM, s)


def _convbert(s: real_cases.Sizes) -> real_cases.RealCase:
    from transformers import ConvBertConfig, ConvBertForSequenceClassification

    config = ConvBertConfig(vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                            num_attention_heads=s.heads, intermediate_size=4 * s.hidden,
                            num_labels=s.classes, embedding_size=s.hidden,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = ConvBertForSequenceClassification(config).eval()
    ids, mask = real_cases._padded(s)
    labels = torch.randint(0, s.classes, (s.batch,))
    return real_cases.RealCase("convbert", "ConvBertForSequenceClassification, small", model,
                               (ids, labels), real_cases._classify, {"attention_mask": mask})


EXTRA: dict[str, Callable[[real_cases.Sizes], real_cases.RealCase]] = {
    "t5": _t5, "mixtral": _mixtral, "gemma": _gemma, "convbert": _convbert}
NAMES = (*real_cases.NAMES, *EXTRA)


def _build(name: str) -> real_cases.RealCase:
    torch.manual_seed(0)
    return EXTRA[name](SMALL) if name in EXTRA else real_cases.BUILDERS[name](SMALL)


def measure(name: str, rounds: int) -> dict[str, Any]:
    """Every method on one model: medians, ``auto``'s choice, agreement (module docstring)."""
    case = _build(name)
    calls: dict[str, Callable[[], Any]] = {}
    for backend in ("auto", *BACKENDS):
        transform = tg.gramian(case.f, backend=backend, batch_dim=0)
        calls[backend] = (lambda t: lambda: t(case.params, *case.inputs, **case.kw_inputs))(
            transform)
    answers: dict[str, Tensor] = {}
    errors: dict[str, str] = {}
    for method, call in list(calls.items()):
        try:
            answers[method] = call()
            call()
        except Exception as error:  # noqa: BLE001 -- a backend that declines: reported
            errors[method] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
            del calls[method]
    times: dict[str, list[float]] = {method: [] for method in calls}
    for r in range(rounds):
        for method in (list(calls) if r % 2 == 0 else list(reversed(calls))):
            start = time.perf_counter()
            calls[method]()
            times[method].append(time.perf_counter() - start)
    medians = {method: statistics.median(t) for method, t in times.items()}
    backends = {b: medians[b] for b in BACKENDS if b in medians}
    best = min(backends, key=lambda b: backends[b])
    ran = tg.explain(case.f, batch_dim=0, run=True)(case.params, *case.inputs,
                                                    **case.kw_inputs).ran
    reference = answers[best].double()
    scale = reference.abs().max().item() or 1.0
    agreement = {m: (answers[m].double() - reference).abs().max().item() / scale
                 for m in answers}
    return {"model": name, "title": case.title, "medians_s": medians, "best": best,
            "auto_over_best": medians["auto"] / medians[best] if "auto" in medians else None,
            "auto_ran": None if ran is None else ran.backend, "agreement": agreement,
            "errors": errors}


def markdown(records: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The results page."""
    lines = ["# Does `auto` pick the fastest backend? Small real models", "",
             f"`{env['command']}` — {env['date']}, {env['commit']}, torch {env['torch']}, "
             f"{env['cpu']}, {env['threads']} torch thread(s), {env['rounds']} alternated rounds, "
             f"load average {env['load_before']} before / {env['load_after']} after, "
             f"{env['wall_s']:.0f} s.", "",
             "Per-sample Gramians (`batch_dim=0`, float32) at small sizes (module docstring); "
             "medians in ms; *auto ÷ best*: `auto` over the fastest backend; *agree*: largest "
             "deviation from the fastest backend's answer, relative to its largest entry.", "",
             "| model | auto ran | best | auto ÷ best | auto | "
             + " | ".join(BACKENDS) + " | agree |",
             "|---|---|---|--:|--:|" + "--:|" * len(BACKENDS) + "--:|"]
    for r in records:
        cells = [f"{r['medians_s'][m] * 1e3:.1f}" if m in r["medians_s"] else "declines"
                 for m in ("auto", *BACKENDS)]
        ratio = "—" if r["auto_over_best"] is None else f"{r['auto_over_best']:.2f}"
        worst = max(r["agreement"].values())
        lines.append(f"| {r['model']} | {r['auto_ran']} | {r['best']} | {ratio} | "
                     + " | ".join(cells) + f" | {worst:.0e} |")
    return "\n".join(lines) + "\n"


def run(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse ``argv``, measure, write ``auto_choice.{md,json}``; return the records."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(NAMES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    threads_before = torch.get_num_threads()
    set_threads(args.threads)
    load_before, start = _load(), time.perf_counter()
    records = []
    try:
        for name in [n.strip() for n in args.models.split(",") if n.strip()]:
            record = measure(name, args.rounds)
            records.append(record)
            print(f"{name:10s} auto ran {record['auto_ran']:10s} best {record['best']:10s} "
                  f"auto/best {record['auto_over_best']:.2f}  " + "  ".join(
                      f"{m} {t * 1e3:.1f}" for m, t in record["medians_s"].items()),
                  flush=True)
    finally:
        torch.set_num_threads(threads_before)
    env = {"command": "python benchmarks/auto_choice.py" + "".join(f" {a}" for a in argv),
           "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
           "commit": _commit(), "torch": torch.__version__, "cpu": _cpu(),
           "threads": args.threads, "rounds": args.rounds,
           "python": platform.python_version(), "load_before": load_before,
           "load_after": _load(), "wall_s": time.perf_counter() - start}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "auto_choice.md").write_text(markdown(records, env))
    (args.out / "auto_choice.json").write_text(json.dumps(
        {"environment": env, "models": records}, indent=1))
    print(f"wrote {args.out / 'auto_choice.md'} in {env['wall_s']:.0f} s")
    return records


if __name__ == "__main__":
    run()
