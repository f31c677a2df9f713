"""Side-by-side timing and memory of torchgram against its peers (not part of the package).

Run ``python benchmarks/run.py`` (or ``python -m benchmarks.run``); see ``benchmarks/README.md``.
"""
