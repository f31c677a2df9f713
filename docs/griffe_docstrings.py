"""Griffe extension: read torchgram's docstrings the way they are written.

* ``Example:`` heads the runnable ``>>>`` examples, a section name the Google style (and
  Sphinx's napoleon) accepts but griffe knows only in the plural; without this, the API
  reference would show the examples as plain text (``>>>`` read as Markdown quotes).
* Sphinx roles (``:func:`gramian```, ``:class:`~x.Y```) would show up literally: they become
  code spans.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|obj|exc):`~?([^`]+)`")


class TorchgramDocstrings(griffe.Extension):
    """Rewrite each docstring as its object is created, before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rename ``Example:`` sections to ``Examples:`` and turn roles into code spans."""
        del kwargs
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(r"``\1``", text)
