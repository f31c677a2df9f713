"""Eager DDP and FSDP2: the Gramian of every rank's graph, and a Jacobian-descent backward."""

__all__: list[str] = []
