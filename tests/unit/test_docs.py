"""The documentation stays true: nothing points at a file or section that does not exist, and
the snippets run.

Runnable snippets: the README's first example, as pasted (it picks the simulated graph runtime
itself without CUDA), and every ```python block in docs/ whose first line is `# runs on CPU`
(docs/guide.md states the convention). Each runs in a fresh process, as a user would run it
pasted into a file. benchmarks/HISTORY.md is checked for links, names and results files; the
scripts it names may since have gone.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import cgcompile

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
HISTORY = ROOT / "benchmarks" / "HISTORY.md"
MARKDOWN = [README, *DOCS, HISTORY]
SOURCES = sorted((ROOT / "cgcompile").rglob("*.py"))
RUNS_ON_CPU = "# runs on CPU"

_PATH = re.compile(
    r"(?<![\w/.$-])((?:docs|examples|benchmarks|tests|cgcompile|\.ci)/[\w./-]*[\w]"
    r"|README\.md|pyproject\.toml)(#[\w-]+)?"
)
_RESULT_FILE = re.compile(r"(?<![\w/-])(\d{4}-\d{2}-\d{2}-h200[\w.{},*-]*\.(?:json|txt))")
_PLACEHOLDER = re.compile(r"[*{}$]|\b(?:DATE|WHAT|COMMIT|OUT|MODE|PREFIX)\b")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_DOTTED = re.compile(r"\bcgcompile\.([A-Za-z_][\w.]*\w)")
_NOWHERE = re.compile(r"\bDESIGN\b|§|\bsee (?:above|below)\b", re.IGNORECASE)
_README_SECTION = re.compile(r"see (?:the )?README, ([A-Z][\w ]*\w)")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _texts() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in [*MARKDOWN, *SOURCES] if p != HISTORY]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("path", [*MARKDOWN, *SOURCES], ids=_rel)
def test_nothing_points_at_a_design_file_or_an_unnamed_place(path: Path) -> None:
    found = [m.group(0) for m in _NOWHERE.finditer(path.read_text())]
    assert not found, f"{_rel(path)} refers to {found}: name the file and section, or say it"


def _missing_results_files(path: Path, text: str) -> list[str]:
    return [
        f"{_rel(path)}: benchmarks/results/{name}"
        for name in _RESULT_FILE.findall(text)
        if not _PLACEHOLDER.search(name) and not (ROOT / "benchmarks/results" / name).exists()
    ]


def test_every_path_named_exists() -> None:
    missing = _missing_results_files(HISTORY, HISTORY.read_text())
    for path, text in _texts():
        for match in _PATH.finditer(text):
            name, anchor = match.group(1).rstrip("."), match.group(2)
            target = ROOT / name
            if _PLACEHOLDER.search(name) or target.exists() and not anchor:
                continue
            if not target.exists():
                missing.append(f"{_rel(path)}: {name}")
            elif anchor and target.suffix == ".md" and anchor[1:] not in _anchors(target):
                missing.append(f"{_rel(path)}: {name}{anchor} (no such section)")
        missing += _missing_results_files(path, text)
    assert not missing, "missing:\n" + "\n".join(missing)


@pytest.mark.parametrize("path", MARKDOWN, ids=_rel)
def test_every_markdown_link_resolves(path: Path) -> None:
    broken = []
    for target in _LINK.findall(path.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        name, _, anchor = target.partition("#")
        file = (path.parent / name).resolve() if name else path
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no such section)")
    assert not broken, f"{_rel(path)}: broken links {broken}"


def test_readme_sections_named_in_the_code_exist() -> None:
    sections = {h.lower() for h in re.findall(r"^#+ (.+)$", README.read_text(), re.MULTILINE)}
    stale = [
        f"{_rel(path)}: {m.group(0)}"
        for path, text in _texts()
        for m in _README_SECTION.finditer(text)
        if m.group(1).lower() not in sections
    ]
    assert not stale, f"README has no such section: {stale}"


def _resolve(dotted: str) -> bool:
    obj: object = cgcompile
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module("cgcompile." + ".".join(parts[: i + 1]))
        except ImportError:
            return False
    return True


@pytest.mark.parametrize("path", MARKDOWN, ids=_rel)
def test_every_cgcompile_name_in_the_docs_exists(path: Path) -> None:
    unknown = sorted({n for n in _DOTTED.findall(path.read_text()) if not _resolve(n)})
    assert not unknown, f"{_rel(path)} names cgcompile.{unknown}, which do not exist"


def _python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line, code) of every ```python block."""
    text = path.read_text()
    return [
        (text[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    ]


def _start(code: str, script: Path | None = None) -> subprocess.Popen[str]:
    """`code` (or the script at `script`) in a fresh Python process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(script)] if script else [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _readme_example() -> str:
    text = README.read_text()
    start = text.index("## A first example")
    return next(code for line, code in _python_blocks(README) if line > text[:start].count("\n"))


def _readme_promise() -> str:
    """The line the README says its first example prints: `It prints `...``."""
    text = README.read_text()
    after = text[text.index("## A first example") :]
    return re.search(r"It prints `([^`]+)`", after.replace("\n", " ")).group(1)


def test_readme_example_is_short_and_runs_under_inference_mode() -> None:
    code = _readme_example()
    assert len(code.splitlines()) < 25
    assert "torch.inference_mode()" in code or "torch.no_grad()" in code
    assert "simulated" in code, "without CUDA the example must pick the simulated runtime itself"


def test_readme_example_prints_what_the_readme_says_on_cpu(runs: dict[str, Any]) -> None:
    """Pasted as it stands, on this CPU: the line the README promises, and no warning."""
    assert _readme_promise() == "outputs equal eager's; CUDA graphs captured: 3"
    code, out, err = runs["README.md"]()
    assert code == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == _readme_promise()
    assert "WARNING" not in err and "Warning" not in err, err


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 150


EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
RUNNABLE = [
    (f"{_rel(path)}:{line}", code)
    for path in DOCS
    for line, code in _python_blocks(path)
    if code.startswith(RUNS_ON_CPU + "\n")
]


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Callable[[], tuple[int, str, str]]]]:
    """Every runnable snippet started at once in its own process (they take seconds each,
    mostly importing torch and compiling); each test waits for its own."""
    started = {"README.md": _start(_readme_example())}
    started |= {name: _start(code) for name, code in RUNNABLE}
    started |= {_rel(path): _start("", path) for path in EXAMPLES}

    def waiter(proc: subprocess.Popen[str]) -> Callable[[], tuple[int, str, str]]:
        def wait() -> tuple[int, str, str]:
            out, err = proc.communicate(timeout=180)
            return proc.returncode, out, err

        return wait

    yield {name: waiter(proc) for name, proc in started.items()}
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_docs_have_runnable_snippets() -> None:
    assert len(RUNNABLE) >= 4


@pytest.mark.parametrize("name", [name for name, _ in RUNNABLE])
def test_doc_snippet_runs_on_cpu(name: str, runs: dict[str, Any]) -> None:
    code, out, err = runs[name]()
    assert code == 0, f"{name}\n{err[-3000:]}"
    assert "WARNING" not in err, f"{name} warns:\n{err}"


@pytest.mark.parametrize("path", EXAMPLES, ids=_rel)
def test_every_example_runs_and_passes_its_own_check(path: Path, runs: dict[str, Any]) -> None:
    """Each example exits 1 when its check fails (hf_generate: no graph captured or replayed)."""
    code, out, err = runs[_rel(path)]()
    assert code == 0, f"{_rel(path)}\n{out[-2000:]}\n{err[-3000:]}"
    assert out.strip(), "it prints what it did"


@pytest.mark.parametrize("path", EXAMPLES, ids=_rel)
def test_every_example_is_a_script(path: Path) -> None:
    text = path.read_text()
    assert 'if __name__ == "__main__":' in text
    assert f"python examples/{path.name}" in text, "its docstring says how to run it"
