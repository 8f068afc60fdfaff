"""The package's layout: the core imports without the lab, and the core's imports form no cycle.

Core: every module directly in ``modeling_weaver/``. Lab: ``modeling_weaver/lab/`` (replay, benchmark, training,
data, the SmolLM2 fetch); it imports the core, the core never imports it (only ``cli`` does, inside the handlers of
its lab subcommands).

The rule for cycles: an import at module level (class bodies and top-level ``try``/``if`` included) runs when the
module is imported, so those edges must form a DAG. An import inside a function runs when the function is called and
is kept apart: such an edge may close a cycle only if it is listed in :data:`LAZY_BACK_EDGES` with its reason, so a
new one fails here until someone decides it is worth keeping.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "modeling_weaver"
LAB = "lab"

#: Function-level imports that close a cycle among core modules, each with why it stays.
LAZY_BACK_EDGES = {
    ("tree", "target"): "tree_budget_bound reads the target's config helpers; target builds on tree's Tree",
    ("modeling_weaver", "convert"): "the Hub code file reaches the package's .pth converter only when asked to",
}


def core_modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py"))


def _targets(node, modules: set[str]) -> list[str]:
    """Core module names (``__init__`` for the package itself) or ``lab`` that an import statement names."""
    if isinstance(node, ast.Import):
        parts = [a.name.split(".") for a in node.names]
        return [p[1] if len(p) > 1 else "__init__" for p in parts if p[0] == "modeling_weaver"]
    if node.level > 1:
        return []
    if node.level == 1:
        path = node.module.split(".") if node.module else []
    elif node.module and node.module.split(".")[0] == "modeling_weaver":
        path = node.module.split(".")[1:]
    else:
        return []
    if path:
        return [path[0]]
    return [a.name if a.name in modules | {LAB} else "__init__" for a in node.names]


def import_edges() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per core module: the core modules (or ``lab``) it imports at module level, and those it imports in functions."""
    modules = set(core_modules())
    top, lazy = {m: set() for m in modules}, {m: set() for m in modules}

    def visit(node, module, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # never runs
            deferred = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in _targets(child, modules):
                    if name != module:
                        (lazy if deferred else top)[module].add(name)
            visit(child, module, deferred)

    for module in modules:
        visit(ast.parse((PACKAGE / f"{module}.py").read_text()), module, False)
    return top, lazy


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def dfs(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_core_imports_without_the_lab():
    code = (
        "import importlib, json, sys\n"
        "import modeling_weaver\n"
        f"for name in {core_modules()!r}:\n"
        "    if name != '__init__':\n"
        "        importlib.import_module(f'modeling_weaver.{name}')\n"
        "from modeling_weaver.cli import build_parser\n"
        "build_parser(None).format_help(); build_parser('convert')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('modeling_weaver'))))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "modeling_weaver.generate" in loaded
    assert not [m for m in loaded if m == f"modeling_weaver.{LAB}" or m.startswith(f"modeling_weaver.{LAB}.")]


def test_core_never_imports_the_lab_but_cli_in_handlers():
    top, lazy = import_edges()
    assert not [m for m, names in top.items() if LAB in names]
    assert [m for m, names in lazy.items() if LAB in names] == ["cli"]


def test_core_import_graph_has_no_cycles():
    top, lazy = import_edges()
    graph = {m: names - {LAB} for m, names in top.items()}
    assert _cycle(graph) is None, f"module-level import cycle: {' -> '.join(_cycle(graph))}"
    full = {m: graph[m] | (lazy[m] - {LAB}) for m in graph}
    closing = {(a, b) for a in lazy for b in lazy[a] - {LAB} if _reaches(full, b, a)}
    known = set(LAZY_BACK_EDGES)
    assert closing <= known, f"function-level imports closing a cycle: {sorted(closing - known)}"
    assert known <= closing, f"no longer cycles, drop from LAZY_BACK_EDGES: {sorted(known - closing)}"
