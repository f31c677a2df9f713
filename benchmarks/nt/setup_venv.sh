#!/usr/bin/env bash
# Create the neural-tangents peer environment at benchmarks/nt/.venv (gitignored).
#
# neural-tangents 0.6.5 breaks with newer jax, so every package is pinned; these versions
# install together on Python 3.11. The venv holds no torch: benchmarks/nt/worker.py runs in
# it as a subprocess of the main environment's benchmarks/nt/client.py.
#
# Idempotent: an existing venv whose pins already import is left as it is; otherwise the
# missing pins are installed. Override the interpreter with PYTHON=/path/to/python3.11.
#
#   bash benchmarks/nt/setup_venv.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv"
python="${PYTHON:-python3}"
# scipy is pinned too: jax 0.4.23's jax.scipy.linalg (used by nt.predict) needs
# scipy.linalg.tril, which scipy 1.13 removed ("module 'scipy.linalg' has no attribute 'tril'").
pins=(jax==0.4.23 jaxlib==0.4.23 ml_dtypes==0.5.1 numpy==1.26.4 tf2jax==0.3.6
      neural-tangents==0.6.5 scipy==1.12.0)

check() {
    "$venv/bin/python" - <<'PY'
from importlib.metadata import version

import jax.scipy.linalg  # noqa: F401  (fails with scipy >= 1.13)
import neural_tangents  # noqa: F401

want = {"jax": "0.4.23", "jaxlib": "0.4.23", "ml_dtypes": "0.5.1", "numpy": "1.26.4",
        "tf2jax": "0.3.6", "neural-tangents": "0.6.5", "scipy": "1.12.0"}
got = {name: version(name) for name in want}
bad = {name: (got[name], v) for name, v in want.items() if got[name] != v}
if bad:
    raise SystemExit(f"pinned versions differ (got, wanted): {bad}")
PY
}

if [[ -x "$venv/bin/python" ]] && check 2>/dev/null; then
    echo "neural-tangents venv already set up at $venv"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet "${pins[@]}"
check
"$venv/bin/python" -c 'import jax, neural_tangents as nt; print("jax", jax.__version__, "neural-tangents", nt.__version__, "at", nt.__file__)'
