"""The package as users see it: typed, every public name documented, logging as the docs say."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cgcompile
from cgcompile.calls.forward_context import BatchDescriptor
from cgcompile.calls.report import describe_key

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
GUIDE = (ROOT / "docs" / "guide.md").read_text()


def test_py_typed_is_shipped() -> None:
    tomllib = pytest.importorskip("tomllib")
    assert (Path(cgcompile.__file__).parent / "py.typed").is_file()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["cgcompile"]


def _own_doc(obj: object, name: str) -> str | None:
    """The object's own docstring: not inherited, not the signature a dataclass makes up."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return None if not doc or doc.startswith(f"{name}(") else doc


def _public_callables() -> list[tuple[str, object]]:
    found = []
    for name in cgcompile.__all__:
        obj = getattr(cgcompile, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            found.append((name, obj))
        if not inspect.isclass(obj):
            continue
        members: dict[str, object] = {}  # its own and what it inherits from cgcompile classes
        for cls in reversed(obj.__mro__):
            if cls.__module__.startswith("cgcompile"):
                members |= vars(cls)
        for attr, member in members.items():
            if isinstance(member, (classmethod, staticmethod)):
                member = member.__func__
            elif isinstance(member, property):
                member = member.fget
            if not attr.startswith("_") and inspect.isfunction(member):
                found.append((f"{name}.{attr}", member))
    return found


@pytest.mark.parametrize(("name", "obj"), _public_callables(), ids=lambda x: str(x)[:40])
def test_every_public_callable_has_a_docstring(name: str, obj: object) -> None:
    assert _own_doc(obj, name.rsplit(".", 1)[-1]), f"{name} has no docstring"


def test_mark_dynamic_batch_docstring_explains_its_arguments() -> None:
    doc = inspect.getdoc(cgcompile.mark_dynamic_batch) or ""
    for argument in ("`dim`", "`unbacked`", "`hint`"):
        assert argument in doc


def test_reference_key_notation_is_what_reports_print() -> None:
    key = (BatchDescriptor(24, num_reqs=24, uniform=True), (24, 24), 0)
    assert describe_key(key) == "24u24[24, 24]"
    assert "`24u24[24, 24]`" in REFERENCE
    assert describe_key((BatchDescriptor(8), (8,), 0)) == "8"
    assert "`8`" in REFERENCE
    assert describe_key((BatchDescriptor(8), (8,), 1)) == "8#1"
    assert "`8#1`" in REFERENCE


def test_docs_say_how_to_validate_and_log() -> None:
    for doc in (REFERENCE, GUIDE):
        for text in ("validate_options", "TORCH_LOGS=+cgcompile", 'getLogger("cgcompile")'):
            assert text in doc


def test_torch_logs_enables_cgcompile_debug_logs() -> None:
    """`TORCH_LOGS=+cgcompile` works without registering anything: torch accepts any module."""
    script = textwrap.dedent(
        """
        import torch
        import cgcompile
        f = torch.compile(lambda x: x * 2, backend="cudagraph_modes",
                          options={"graph_runtime": "simulated", "compiler": "eager"})
        f(torch.ones(4))  # a warm-up call
        f(torch.ones(4))  # captures
        """
    )
    env = {**os.environ, "TORCH_LOGS": "+cgcompile", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cgcompile/backend/pipeline.py" in result.stderr  # INFO: the resolved mode
    assert "cgcompile/calls/cuda_graph_wrapper.py" in result.stderr  # DEBUG: captures


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The cgcompile modules a file imports (anywhere in it, TYPE_CHECKING blocks included):
    `from pkg import mod` counts as `pkg.mod`, not as the package."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cgcompile"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cgcompile"))
    return found


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_imports_flow_one_way_without_circles() -> None:
    """Folders stand by when their code runs, each importing only those below it: restart/
    (a new process) over backend/ (once per graph) over calls/ (every call) over graphs/ (each
    capture and replay); passes/ (pure FX) and the top-level modules import no folder; no
    module imports itself back through another."""
    files = {_module_of(p): p for p in (ROOT / "cgcompile").rglob("*.py")}
    graph = {
        m: {i for i in _imports(p, set(files)) if i in files and i != m} for m, p in files.items()
    }
    floors = ["graphs", "calls", "backend", "restart"]
    folders = {*floors, "passes"}
    for module, imported in graph.items():
        if module == "cgcompile":  # the public API gathers names from every floor
            continue
        layer = module.split(".")[1]
        if layer in floors:  # a floor imports no floor above it; only compile code runs passes
            banned = set(floors[floors.index(layer) + 1 :])
            banned |= {"passes"} if layer in ("graphs", "calls") else set()
        else:
            banned = folders - {layer}
        bad = [i for i in imported if i.split(".")[1:2] and i.split(".")[1] in banned]
        assert not bad, f"{module} imports {bad}"

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == target or (nxt not in seen and (seen.add(nxt) or reaches(nxt, target, seen))):
                return True
        return False

    circles = [m for m in graph if reaches(m, m, set())]
    assert not circles, f"modules in an import circle: {circles}"
