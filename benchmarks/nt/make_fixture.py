"""Write ``tests/data/nt_reference.{npz,json}``: neural-tangents' answers on tiny models.

Runs in the neural-tangents venv (float64, one thread)::

    benchmarks/nt/.venv/bin/python benchmarks/nt/make_fixture.py

The fixture lets ``torchgram.ntk``'s tests check NT's semantics without jax. It holds

* two tiny models with their weights: an MLP 3→5→4 (tanh; ``mlp.w0 [3, 5]``, ``x @ w + b``)
  and a CNN on 2×5×5 images in torch's own layout (``cnn.w0 [3, 2, 3, 3]`` OIHW, NCHW inputs:
  ``F.conv2d`` takes them as they are; ``cnn.w2 [4, 3]`` is ``[in, out]``), inputs ``x1``
  (N1 = 3), ``x2`` (N2 = 2) and ``x3`` (N = 3, for diagonal kernels between two different
  inputs), their outputs, and the dense generalized Gramians
  ``J(x1) J(x)ᵀ`` in torch's ``[N1, K, N2, K]`` layout;
* NT's kernel for every ``trace_axes ∈ {(), (-1,)}`` × ``diagonal_axes ∈ {(), (0,), (-1,),
  (0, -1)}`` × ``x2 ∈ {None, x2, x3}`` that NT accepts, and the message of each one it rejects;
* ``nt.predict.gradient_descent_mse`` and ``nt.predict.gp_inference`` outputs on the MLP's
  kernels.

Every kernel is checked against the dense Gramian through :mod:`semantics` (mean over a
traced pair, interleaved axes, diagonal in place), every implementation against the others,
``vmap_axes=None`` against ``vmap_axes=0``, and every predict output against the numpy
formulas of :mod:`semantics`; the script fails if any check does. The JSON next to the npz
describes every array.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import semantics  # noqa: E402
import worker  # noqa: E402

OUT = HERE.parents[1] / "tests" / "data" / "nt_reference"
IMPLEMENTATIONS = ("JACOBIAN_CONTRACTION", "NTK_VECTOR_PRODUCTS", "STRUCTURED_DERIVATIVES")
TRACE = ((), (-1,))
DIAGONAL = ((), (0,), (-1,), (0, -1))
TIMES = (0.0, 1.0, 10.0, 100.0, 1e4)
PREDICT_SETTINGS = ({"learning_rate": 1.0, "diag_reg": 0.0, "diag_reg_absolute_scale": False},
                    {"learning_rate": 0.5, "diag_reg": 0.1, "diag_reg_absolute_scale": False},
                    {"learning_rate": 1.0, "diag_reg": 0.1, "diag_reg_absolute_scale": True})
RTOL = 1e-10


def _tag(axes: tuple[int, ...]) -> str:
    return "_".join(str(a).replace("-", "m") for a in axes) or "none"


def _models(rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    normal = rng.standard_normal
    mlp = {"layers": [{"op": "dense", "w": "w0", "b": "b0"}, {"op": "tanh"},
                      {"op": "dense", "w": "w1", "b": "b1"}],
           "layout": "NCHW",
           "arrays": {"w0": normal((3, 5)) / np.sqrt(3), "b0": 0.1 * normal(5),
                      "w1": normal((5, 4)) / np.sqrt(5), "b1": 0.1 * normal(4),
                      "x1": normal((3, 3)), "x2": normal((2, 3)), "x3": normal((3, 3))},
           "description": "x @ w0 + b0 -> tanh -> @ w1 + b1; weights [in, out]; logits [N, 4]"}
    cnn = {"layers": [{"op": "conv", "w": "w0", "b": "b0", "stride": [1, 1],
                       "padding": [[1, 1], [1, 1]]}, {"op": "relu"},
                      {"op": "conv", "w": "w1", "b": "b1", "stride": [2, 2],
                       "padding": [[0, 0], [0, 0]]}, {"op": "relu"},
                      {"op": "avgpool_global"}, {"op": "dense", "w": "w2", "b": "b2"}],
           "layout": "NCHW",
           "arrays": {"w0": normal((3, 2, 3, 3)) / np.sqrt(18), "b0": 0.1 * normal(3),
                      "w1": normal((4, 3, 3, 3)) / np.sqrt(27), "b1": 0.1 * normal(4),
                      "w2": normal((4, 3)) / 2.0, "b2": 0.1 * normal(3),
                      "x1": normal((3, 2, 5, 5)), "x2": normal((2, 2, 5, 5)),
                      "x3": normal((3, 2, 5, 5))},
           "description": "NCHW: conv2d(w0 [3,2,3,3] OIHW, b0, stride 1, padding 1) -> relu -> "
                          "conv2d(w1 [4,3,3,3], b1, stride 2, padding 0) -> relu -> mean over "
                          "H, W -> @ w2 [4,3] ([in, out]) + b2; logits [N, 3]"}
    return {"mlp": mlp, "cnn": cnn}


def _dense_gramian(f: Any, params: Any, xa: Any, xb: Any) -> np.ndarray:
    """``J(xa) J(xb)ᵀ`` as ``S_a + S_b`` (every parameter leaf flattened and concatenated)."""
    import jax
    import jax.numpy as jnp

    def flat_jacobian(x: Any) -> Any:
        jac = jax.jacrev(lambda p: f(p, x))(params)
        out_ndim = f(params, x).ndim
        leaves = jax.tree_util.tree_leaves(jac)
        rows = int(np.prod(leaves[0].shape[:out_ndim]))
        return jnp.concatenate([leaf.reshape(rows, -1) for leaf in leaves], axis=1)

    ja, jb = flat_jacobian(xa), flat_jacobian(xb)
    shape = f(params, xa).shape + f(params, xb).shape
    return np.asarray(ja @ jb.T).reshape(shape)


def _close(a: np.ndarray, b: np.ndarray) -> float:
    """Largest difference relative to the largest entry of ``b``."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _explain(result: np.ndarray, gram: np.ndarray, ndim: int, trace: tuple[int, ...],
             diagonal: tuple[int, ...]) -> str:
    """Say what an implementation returned for a combination the reference rejects."""
    kept = tuple(d for d in semantics.canonical_axes(diagonal, ndim)
                 if d not in semantics.canonical_axes(trace, ndim))
    n = min(gram.shape[0], gram.shape[ndim])
    square = gram[(slice(0, n),) + (slice(None),) * (ndim - 1) + (slice(0, n),)]
    candidates = {
        "the kernel with the traced axes dropped from diagonal_axes (trace wins)":
            lambda: semantics.to_nt_layout(gram, ndim, trace, kept),
        "as if x1 and x2 were cut to their first min(N1, N2) samples":
            lambda: semantics.to_nt_layout(square, ndim, trace, diagonal),
    }
    for text, candidate in candidates.items():
        try:
            value = candidate()
        except Exception:  # noqa: BLE001 - a candidate that does not apply
            continue
        if value.shape == result.shape and _close(result, value) < RTOL:
            return f"shape {list(result.shape)}: {text}"
    return f"shape {list(result.shape)}: not explained"


def _kernels(name: str, model: dict[str, Any], arrays: dict[str, np.ndarray],
             meta: dict[str, Any]) -> None:
    import jax.numpy as jnp
    import neural_tangents as nt

    f = worker.build_apply(model["layers"], model["layout"])
    params = worker.build_params(model["layers"], model["arrays"])
    x1, x2, x3 = (jnp.asarray(model["arrays"][k]) for k in ("x1", "x2", "x3"))
    fx1, fx2 = np.asarray(f(params, x1)), np.asarray(f(params, x2))
    for key, value in model["arrays"].items():
        arrays[f"{name}.{key}"] = value
    arrays[f"{name}.fx1"], arrays[f"{name}.fx2"] = fx1, fx2
    grams = {"x1x1": _dense_gramian(f, params, x1, x1), "x1x2": _dense_gramian(f, params, x1, x2),
             "x1x3": _dense_gramian(f, params, x1, x3)}
    for pair, gram in grams.items():
        arrays[f"{name}.gram.{pair}"] = gram
    entries: list[dict[str, Any]] = []
    for trace in TRACE:
        for diagonal in DIAGONAL:
            for pair, second in (("x1x1", None), ("x1x2", x2), ("x1x3", x3)):
                key = f"{name}.ntk.trace_{_tag(trace)}.diag_{_tag(diagonal)}.{pair}"
                entry: dict[str, Any] = {"key": key, "model": name, "trace_axes": list(trace),
                                         "diagonal_axes": list(diagonal),
                                         "x2": None if second is None else pair[2:],
                                         "implementations": {}}
                results: dict[str, np.ndarray] = {}
                for impl in IMPLEMENTATIONS:
                    try:
                        ntk_fn = nt.empirical_ntk_fn(
                            f, trace_axes=trace, diagonal_axes=diagonal, vmap_axes=0,
                            implementation=getattr(nt.NtkImplementation, impl))
                        results[impl] = np.asarray(ntk_fn(x1, second, params))
                        entry["implementations"][impl] = "ok"
                    except Exception as exc:  # noqa: BLE001 - NT's rejection is the data
                        entry["implementations"][impl] = worker._error(exc)
                try:
                    expected = semantics.to_nt_layout(grams[pair], fx1.ndim, trace, diagonal)
                    entry["reference"] = "ok"
                except ValueError as exc:
                    expected, entry["reference"] = None, f"rejected: {exc}"
                entry["accepted"] = entry["implementations"]["JACOBIAN_CONTRACTION"] == "ok"
                if expected is not None:
                    entry["shape"] = list(expected.shape)
                    diffs = {impl: (_close(r, expected) if r.shape == expected.shape else None)
                             for impl, r in results.items()}
                    entry["max_rel_diff_to_dense_reference"] = diffs
                    entry["matches_reference"] = len(results) == len(IMPLEMENTATIONS) and all(
                        d is not None and d < RTOL for d in diffs.values())
                    if entry["matches_reference"]:
                        plain = nt.empirical_ntk_fn(f, trace_axes=trace, diagonal_axes=diagonal,
                                                    vmap_axes=None)(x1, second, params)
                        entry["vmap_axes_none_max_rel_diff"] = _close(
                            np.asarray(plain), results["JACOBIAN_CONTRACTION"])
                        arrays[key] = results["JACOBIAN_CONTRACTION"]
                        entry["stored"] = True
                else:
                    entry["matches_reference"] = not entry["accepted"]
                    entry["rejected_combination_outputs"] = {
                        impl: _explain(r, grams[pair], fx1.ndim, trace, diagonal)
                        for impl, r in results.items()}
                entry.setdefault("stored", False)
                entries.append(entry)
    meta["kernels"].extend(entries)


def _predict(arrays: dict[str, np.ndarray], meta: dict[str, Any],
             rng: np.random.Generator) -> None:
    import jax.numpy as jnp
    import neural_tangents as nt

    y_train = rng.standard_normal((3, 4))
    arrays["predict.y_train"] = y_train
    fx_train_0, fx_test_0 = arrays["mlp.fx1"], arrays["mlp.fx2"]
    arrays["predict.t"] = np.asarray(TIMES)
    entries: list[dict[str, Any]] = []
    for trace in TRACE:
        tag = _tag(trace)
        k_tt = arrays[f"mlp.ntk.trace_{tag}.diag_none.x1x1"]
        # k_test_train = NT(x2, x1): compute it with NT rather than transposing by hand
        f = worker.build_apply([{"op": "dense", "w": "w0", "b": "b0"}, {"op": "tanh"},
                                {"op": "dense", "w": "w1", "b": "b1"}], "NCHW")
        params = [{"w": jnp.asarray(arrays["mlp.w0"]), "b": jnp.asarray(arrays["mlp.b0"])},
                  None,
                  {"w": jnp.asarray(arrays["mlp.w1"]), "b": jnp.asarray(arrays["mlp.b1"])}]
        ntk_fn = nt.empirical_ntk_fn(f, trace_axes=trace, vmap_axes=0)
        k_st = np.asarray(ntk_fn(jnp.asarray(arrays["mlp.x2"]), jnp.asarray(arrays["mlp.x1"]),
                                 params))
        k_ss = np.asarray(ntk_fn(jnp.asarray(arrays["mlp.x2"]), None, params))
        arrays[f"predict.k_test_train.trace_{tag}"] = k_st
        arrays[f"predict.k_test_test.trace_{tag}"] = k_ss
        entries.append({"key": f"predict.k_test_train.trace_{tag}",
                        "what": "NT's kernel(x2, x1) on the MLP (k_test_train)",
                        "shape": list(k_st.shape)})
        entries.append({"key": f"predict.k_test_test.trace_{tag}",
                        "what": "NT's kernel(x2, None) on the MLP, for gp_inference's "
                                "k_test_test", "shape": list(k_ss.shape)})
        for index, setting in enumerate(PREDICT_SETTINGS):
            prefix = f"predict.gd.trace_{tag}.s{index}"
            predict_fn = nt.predict.gradient_descent_mse(
                jnp.asarray(k_tt), jnp.asarray(y_train), trace_axes=trace, **setting)
            calls = {
                "tinf": dict(t=None, fx_train_0=fx_train_0, fx_test_0=fx_test_0,
                             k_test_train=k_st),
                "tvec": dict(t=np.asarray(TIMES), fx_train_0=fx_train_0, fx_test_0=fx_test_0,
                             k_test_train=k_st),
                "t1": dict(t=1.0, fx_train_0=fx_train_0, fx_test_0=fx_test_0,
                           k_test_train=k_st),
                "tvec_train_only_f0_zero": dict(t=np.asarray(TIMES)),
                "tinf_f0_zero": dict(t=None, fx_train_0=0.0, fx_test_0=np.zeros_like(fx_test_0),
                                     k_test_train=k_st),
            }
            for call_name, kwargs in calls.items():
                out = predict_fn(**kwargs)
                train, test = (out, None) if not isinstance(out, tuple) else out
                ref_train, ref_test = semantics.gradient_descent_mse(
                    k_tt, y_train, trace_axes=trace, **setting,
                    **{k: v for k, v in kwargs.items()})
                entry = {"key": f"{prefix}.{call_name}", "trace_axes": list(trace),
                         "k_train_train": f"mlp.ntk.trace_{tag}.diag_none.x1x1",
                         "k_test_train": f"predict.k_test_train.trace_{tag}",
                         "y_train": "predict.y_train", **setting,
                         "t": None if kwargs["t"] is None else (
                             "predict.t" if np.ndim(kwargs["t"]) else kwargs["t"]),
                         "fx_train_0": ("mlp.fx1" if kwargs.get("fx_train_0", 0.0) is fx_train_0
                                        else 0.0),
                         "fx_test_0": (None if "fx_test_0" not in kwargs else
                                       "mlp.fx2" if kwargs["fx_test_0"] is fx_test_0 else
                                       "zeros"),
                         "train_shape": list(np.shape(train))}
                arrays[f"{prefix}.{call_name}.train"] = np.asarray(train)
                entry["train_rel_diff_to_formula"] = _close(np.asarray(train), ref_train)
                if test is not None:
                    arrays[f"{prefix}.{call_name}.test"] = np.asarray(test)
                    entry["test_shape"] = list(np.shape(test))
                    entry["test_rel_diff_to_formula"] = _close(np.asarray(test), ref_test)
                entries.append(entry)
            gp = nt.predict.gp_inference(jnp.asarray(k_tt), jnp.asarray(y_train),
                                         trace_axes=trace, diag_reg=setting["diag_reg"],
                                         diag_reg_absolute_scale=setting[
                                             "diag_reg_absolute_scale"])
            mean = np.asarray(gp(get="ntk", k_test_train=jnp.asarray(k_st)))
            cov = gp(get="ntkgp", k_test_train=jnp.asarray(k_st), k_test_test=jnp.asarray(k_ss))
            key = f"predict.gp.trace_{tag}.s{index}"
            arrays[f"{key}.mean"] = mean
            arrays[f"{key}.ntkgp_cov"] = np.asarray(cov.covariance)
            ref_mean = semantics.gp_inference_mean(k_tt, y_train, k_st, setting["diag_reg"],
                                                   setting["diag_reg_absolute_scale"], trace)
            entries.append({"key": key, "trace_axes": list(trace),
                            "diag_reg": setting["diag_reg"],
                            "diag_reg_absolute_scale": setting["diag_reg_absolute_scale"],
                            "mean_shape": list(mean.shape),
                            "ntkgp_cov_shape": list(np.shape(cov.covariance)),
                            "mean_rel_diff_to_formula": _close(mean, ref_mean),
                            "ntkgp_cov_rel_diff_to_formula": _close(
                                np.asarray(cov.covariance), semantics.gp_inference_ntkgp_cov(
                                    k_tt, k_st, k_ss, setting["diag_reg"],
                                    setting["diag_reg_absolute_scale"])),
                            "ntkgp_cov_mean_equals_mean": _close(np.asarray(cov.mean), mean)})
    meta["predict"] = entries


def main() -> int:
    """Compute, check and write the fixture; return 1 if any check failed."""
    worker.configure_threads(1)
    import jax

    jax.config.update("jax_enable_x64", True)
    import neural_tangents as nt

    rng = np.random.default_rng(11)
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {
        "generated_by": "benchmarks/nt/make_fixture.py (benchmarks/nt/.venv)",
        "versions": {"jax": jax.__version__, "neural_tangents": nt.__version__},
        "dtype": "float64", "models": {}, "kernels": [],
        "layout_note": "ntk keys hold NT's kernels in NT's layout; gram keys hold the dense "
                       "J(x1) J(x)^T in torch's [N1, K, N2, K] layout",
    }
    for name, model in _models(rng).items():
        meta["models"][name] = {"description": model["description"],
                                "layers": model["layers"], "layout": model["layout"],
                                "arrays": {k: list(v.shape) for k, v in model["arrays"].items()}}
        _kernels(name, model, arrays, meta)
    _predict(arrays, meta, rng)
    meta["arrays"] = {key: {"shape": list(value.shape), "dtype": str(value.dtype)}
                      for key, value in sorted(arrays.items())}
    failures = [e["key"] for e in meta["kernels"] if not e["matches_reference"]
                or e.get("vmap_axes_none_max_rel_diff", 0.0) > RTOL]
    failures += [e["key"] for e in meta["predict"]
                 if max((v for k, v in e.items() if k.endswith("to_formula")), default=0.0)
                 > 1e-8]
    meta["checks_failed"] = failures
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT.with_suffix(".npz"), **arrays)
    OUT.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {OUT.with_suffix('.npz')} ({len(arrays)} arrays); failed checks: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
