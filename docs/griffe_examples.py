"""Griffe extension: read the ``Example:`` sections of torchgram's docstrings as examples.

torchgram's Google-style docstrings head their runnable ``>>>`` examples with ``Example:``,
a name the Google style (and Sphinx's napoleon) accepts; griffe only knows the plural. Without
this, the API reference would show the examples as plain text (``>>>`` read as Markdown
quotes) instead of code blocks.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` section headers to ``Examples:`` before docstrings are parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the docstring of each object as it is created, if it has one."""
        del kwargs
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
