"""Imperative API on an existing autograd graph (reserved; the graph backend fills it)."""

__all__: list[str] = []
