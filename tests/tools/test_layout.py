"""The package's shape (DESIGN §6.1): no import circle, the core never imports the shells,
the public names keep their import paths, and the wheel ships every subpackage."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import statemachine

PACKAGE = Path(statemachine.__file__).parent
SHELLS = ("runner", "adapters", "testing", "cli", "console", "__main__")
"""Subpackages (and the entry point) the core must never import."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every package module ``path`` imports at run time (function-level imports
    included; ``if TYPE_CHECKING:`` blocks excluded), resolved to a module name."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("statemachine"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "statemachine"):
            base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules)
    graph = {}
    for name, path in modules.items():
        edges = imports_of(path, names)
        edges.discard(name)
        edges.discard("statemachine")  # every module's parent package; not an edge here
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, or None (iterative DFS with colours)."""
    colour = dict.fromkeys(graph, 0)
    for root in sorted(graph):
        if colour[root]:
            continue
        stack: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        path = [root]
        colour[root] = 1
        while stack:
            node, pending = stack[-1]
            if not pending:
                colour[node] = 2
                stack.pop()
                path.pop()
                continue
            nxt = pending.pop()
            if colour.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if colour.get(nxt) == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, sorted(graph[nxt])))
    return None


def _shell(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SHELLS else None


def test_no_import_circle() -> None:
    assert find_cycle(import_graph()) is None


def test_the_core_never_imports_a_shell() -> None:
    offenders = {
        (module, target)
        for module, edges in import_graph().items() if _shell(module) is None
        for target in edges if _shell(target) is not None
    }
    assert not offenders


def test_the_checks_see_a_planted_circle_and_a_planted_shell_import() -> None:
    graph = import_graph()
    graph["statemachine.values"] = {*graph["statemachine.values"], "statemachine.controller"}
    assert find_cycle(graph) is not None
    path = PACKAGE / "machine.py"
    planted = imports_of(path, set(_modules())) | {"statemachine.runner.loop"}
    assert any(_shell(t) for t in planted)
    tree_with_local_import = "def f():\n    from statemachine.runner import loop\n"
    probe = PACKAGE.parent / "probe_for_layout_test.py"
    try:
        probe.write_text(tree_with_local_import)
        assert imports_of(probe, set(_modules())) == {"statemachine.runner.loop"}
    finally:
        probe.unlink()


def test_the_public_names_keep_their_paths() -> None:
    from statemachine import (  # noqa: F401 - DESIGN §3.1, verbatim
        Acknowledge,
        Action,
        Append,
        ConcurrencyConflict,
        ControlError,
        EventStore,
        Execute,
        GuardrailResult,
        InvalidTransition,
        MemoryEventStore,
        PublicationUnsettled,
        ReconcileRejected,
        RecoveryPolicy,
        Resend,
        RunController,
        RunNotResumable,
        SchemaError,
        SQLiteEventStore,
        Step,
        ToolCall,
        ToolInDoubt,
    )
    from statemachine.runner import Agent, FunctionTool, Runner, publish, settle  # noqa: F401
    from statemachine.sessions import MemorySession, Session, SQLiteSession  # noqa: F401
    from statemachine.testing import FlakySession, ScriptedModel, check_log  # noqa: F401

    assert set(statemachine.__all__) <= set(dir(statemachine))


def test_the_wheel_ships_every_subpackage(tmp_path: Path) -> None:
    root = PACKAGE.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(root)],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    expected = {str(p.relative_to(root)) for p in PACKAGE.rglob("*.py")}
    # the console's pages and stylesheet are package data
    expected |= {str(p.relative_to(root)) for p in (PACKAGE / "console").rglob("*.*")
                 if p.suffix in (".html", ".css")}
    assert any(name.endswith(".html") for name in expected)
    assert expected <= shipped
    packages = sorted(_module_name(p) for p in PACKAGE.rglob("__init__.py"))
    site = str(tmp_path / "site")
    code = ("import importlib, sys\nfor n in sys.argv[2:]:\n"
            "    m = importlib.import_module(n)\n"
            "    assert m.__file__.startswith(sys.argv[1]), m.__file__\n")
    subprocess.run([sys.executable, "-c", code, site, *packages], check=True,
                   cwd=site, env={"PYTHONPATH": site})


def test_the_cli_and_the_kit_import_without_hypothesis() -> None:
    """The base install has no Hypothesis (it comes with the ``testing`` extra), yet the
    CLI's demo and explorer use the kit: importing it, and running the demo's and the
    explorer's code paths' imports, must not need Hypothesis (only drawing a case does)."""
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "import statemachine.testing, statemachine.cli.demo, statemachine.cli.main\n"
            "from statemachine.testing import ReferenceWorld, explore, play_handoff, "
            "HandoffCase\n"
            "play_handoff(HandoffCase(('approved',), False))\n"
            "try:\n"
            "    statemachine.testing.handoff_cases()\n"
            "except ImportError:\n"
            "    pass\n"
            "else:\n"
            "    raise SystemExit('a strategy was built without Hypothesis')\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
