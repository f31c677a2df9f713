"""MkDocs hook: bring repository files into the site, and generate the design-notes page.

The home page includes ``README.md`` (``docs/index.md``), whose links point at repository
files relative to the root (``examples/quickstart.py``, ``notebooks/ntk.ipynb``,
``benchmarks/results/benchmarks.md``). :func:`on_files` adds those files to the site under the
same paths, so the links resolve (notebooks become pages through ``mkdocs-jupyter``, the
benchmark results a page) and nothing is copied into ``docs/`` where it could drift.

It also generates ``design/notes.md`` from the source: the docstring of every module under
``torchgram/backends/`` and of every other module with a ``NOTE [title]`` block, and every
``# NOTE [title]`` comment block (the long design rationale that code refers back to by
title). It globs ``src/torchgram``, so the page follows modules wherever they move.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

# Repository files published under their own path (globs relative to the repository root).
REPOSITORY_FILES = (
    "examples/*.py",
    "notebooks/*.ipynb",
    "benchmarks/README.md",
    "benchmarks/results/benchmarks.md",
    "benchmarks/results/benchmarks.png",
    "benchmarks/WEIGHTING_NOTES.md",
    "benchmarks/results/weighting.md",
    "benchmarks/results/compose.md",
    "benchmarks/results/ntk.md",
    "benchmarks/results/eager.md",
    "benchmarks/nt/SEMANTICS.md",
    "benchmarks/results/distributed.md",
    "benchmarks/results/real_models.md",
    "benchmarks/results/scaling.md",
    "benchmarks/results/auto_choice.md",
)
NOTES_PAGE = "design/notes.md"
PACKAGE = Path("src") / "torchgram"

_NOTE = re.compile(r"^# NOTE \[(?P<title>[^\]]+)\]\s*$", re.MULTILINE)
_EXAMPLE = re.compile(r"^(Examples?):\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|obj|exc):`~?([^`]+)`")


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


@event_priority(100)  # before mkdocs-jupyter turns the notebooks into pages
def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    """Add the repository files and the generated design-notes page."""
    root = _root(config)
    for pattern in REPOSITORY_FILES:
        paths = sorted(root.glob(pattern))
        if not paths:
            raise FileNotFoundError(f"docs/hooks.py: no repository file matches {pattern!r}")
        for path in paths:
            src_uri = path.relative_to(root).as_posix()
            files.append(File(src_uri, src_dir=str(root), dest_dir=config.site_dir,
                              use_directory_urls=config.use_directory_urls))
    files.append(File.generated(config, NOTES_PAGE, content=design_notes(root)))
    return files


def design_notes(root: Path) -> str:
    """The design-notes page, as Markdown."""
    lines = [
        "# Notes from the code",
        "",
        "Generated from the source when the documentation is built: the docstring of every",
        "module under `torchgram/backends/` and of every other module that holds a design note,",
        "and every `NOTE [title]` block (code refers back to a note by its title). The",
        "overview is the [design document](index.md).",
        "",
    ]
    backends = f"{PACKAGE.name}/backends/"
    modules = sorted((path.relative_to(root / PACKAGE.parent).as_posix(), path)
                     for path in (root / PACKAGE).rglob("*.py"))
    modules.sort(key=lambda module: not module[0].startswith(backends))  # backends first
    for relative, path in modules:
        source = path.read_text(encoding="utf-8")
        docstring = ast.get_docstring(ast.parse(source), clean=True) or ""
        comments = _comment_notes(source)
        in_backends = relative.startswith(backends)
        if not (in_backends and docstring) and not comments and "# NOTE [" not in docstring:
            continue
        lines += [f"## `{relative}`", ""]
        if docstring:
            lines += [_markdown(docstring), ""]
        for title, body in comments:
            lines += [f"### NOTE [{title}]", "", _markdown(body), ""]
    return "\n".join(lines)


def _comment_notes(source: str) -> list[tuple[str, str]]:
    """``(title, body)`` of every ``# NOTE [title]`` comment block (a run of comment lines)."""
    comments = {token.start[0]: token.string
                for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT}
    notes = []
    for number, comment in sorted(comments.items()):
        match = _NOTE.match(comment)
        if match is None:
            continue
        body, following = [], number + 1
        while following in comments:
            text = comments[following]
            body.append(text[2:] if text.startswith("# ") else text[1:])
            following += 1
        notes.append((match["title"], "\n".join(body)))
    return notes


def _markdown(text: str) -> str:
    """Docstring or comment text (reStructuredText-flavoured) as Markdown."""
    text = _NOTE.sub(lambda m: f"### NOTE [{m['title']}]\n", text)
    text = _ROLE.sub(lambda m: f"``{m[1]}``", text)
    # A Google-style "Example:" section: its indented doctest becomes a code block.
    text = _EXAMPLE.sub(lambda m: f"**{m[1]}:**\n", text)
    # "...::" followed by an indented block: a literal block in reST, code in Markdown.
    return re.sub(r"::$", ":", text, flags=re.MULTILINE)
