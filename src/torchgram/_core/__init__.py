"""The pipeline's core, shared by every backend (DESIGN.md §5).

``options`` (validated once per transform) → ``problem`` (one call, immutable, built before
dispatch) → a backend (``torchgram.backends``: ``problem -> result``) → ``sink`` (row order,
symmetrisation, dtype, shapes). Also here: ``checks`` (argument checks and the message
layout), ``errors`` (a backend's declared inability), ``pytree`` (which leaves are
differentiated), ``rng`` (one random draw per call), ``signature`` (cache keys) and
``_torch_compat`` (every private torch internal the library relies on).
"""
