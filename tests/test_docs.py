"""The documentation builds with warnings as errors, and CI runs the README's test command.

The site is built without executing the notebooks (nbmake executes them in this same test
run); everything else is as published: the README as home page, the API reference from the
docstrings, the design notes from the source, links and anchors checked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("docs")
    out = work / "site"
    # no notebook execution (see above), no end-of-life banner from the theme
    env = {**os.environ, "TORCHGRAM_DOCS_EXECUTE": "false", "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(out)],
        cwd=work,  # mkdocs-jupyter's cache goes here, not into the repository
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


def _text(page: Path) -> str:
    return re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8"))


def test_home_page_is_the_readme(site: Path) -> None:
    text = _text(site / "index.html")
    assert "Set-up: two commands" in text and "Architecture" in text


def test_api_reference_documents_every_public_name(site: Path) -> None:
    import torchgram

    pages = {
        "torchgram": site / "api" / "torchgram" / "index.html",
        "torchgram.autograd": site / "api" / "autograd" / "index.html",
        "torchgram.weighting": site / "api" / "weighting" / "index.html",
        "torchgram.ntk": site / "api" / "ntk" / "index.html",
    }
    modules = {"torchgram": torchgram, "torchgram.autograd": torchgram.autograd,
               "torchgram.weighting": torchgram.weighting, "torchgram.ntk": torchgram.ntk}
    for namespace, page in pages.items():
        html = page.read_text(encoding="utf-8")
        public = [name for name in modules[namespace].__all__
                  if not (namespace == "torchgram" and name in ("autograd", "weighting", "ntk"))]
        for name in public:
            assert f'id="{namespace}.{name}"' in html, f"{namespace}.{name} is not documented"
    for page in pages.values():
        html = page.read_text(encoding="utf-8")
        # "Example:" sections are rendered as code (not Markdown quotes), Sphinx roles as code
        assert "<blockquote>" not in html and ":func:" not in html and ":class:" not in html


def test_design_notes_collect_every_note_of_the_source(site: Path) -> None:
    text = _text(site / "design" / "notes" / "index.html")
    titles = set()
    for path in (ROOT / "src" / "torchgram").rglob("*.py"):
        titles.update(re.findall(r"^\s*# NOTE \[([^\]]+)\]", path.read_text(encoding="utf-8"),
                                 flags=re.MULTILINE))
    assert titles
    missing = [title for title in sorted(titles) if f"NOTE [{title}]" not in text]
    assert not missing


def test_notebooks_are_pages(site: Path) -> None:
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        assert (site / "notebooks" / notebook.stem / "index.html").exists(), notebook.name


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    main_job, tests = _readme_commands()
    assert main_job.startswith('pip install "torch==2.13.0" ')
    assert tests.startswith('pip install "torch==2.13.0" ') and tests.endswith("pytest")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert tests in ci
    # and it installs nothing else
    installs = [line for line in ci.splitlines()
                if "pip install" in line and not line.lstrip().startswith("#")]
    assert len(installs) == 1 and tests in installs[0], installs
