"""The package's layout: the core imports without the lab, the core's imports form no cycle, the loop stays short.

Core: every module in ``modeling_weaver/`` but the lab (the ``decoding/`` package included). Lab:
``modeling_weaver/lab/`` (replay, benchmark, training, data, the SmolLM2 fetch); it imports the core, the core never
imports it (only ``cli`` does, inside the handlers of its lab subcommands).

The rule for cycles: an import at module level (class bodies and top-level ``try``/``if`` included) runs when the
module is imported, so those edges must form a DAG. An import inside a function runs when the function is called and
is kept apart: such an edge may close a cycle only if it is listed in :data:`LAZY_BACK_EDGES` with its reason, so a
new one fails here until someone decides it is worth keeping. The lab's module-level imports form a DAG as well.
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


def modules() -> dict[str, Path]:
    """Dotted name relative to the package (``""`` is the package itself, ``lab.data`` a lab module) → file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def core_modules() -> list[str]:
    return sorted(name for name in modules() if name and name.partition(".")[0] != LAB)


def _imported(node, package: list[str], known: set[str]) -> list[str]:
    """Names in ``known`` (relative to the package) that an import statement loads."""
    if isinstance(node, ast.Import):
        full = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        full = [f"{base}.{a.name}" if f"{base}.{a.name}".partition(".")[2] in known else base for a in node.names]
    names = []
    for name in full:
        head, _, rest = name.partition(".")
        if head != "modeling_weaver":
            continue
        while rest not in known:  # an attribute of a module, not a module: the module
            rest = rest.rpartition(".")[0]
        names.append(rest)
    return names


def import_edges() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per module (``lab`` stands for the whole lab in the core's edges): what it imports at module level, and what
    it imports inside functions."""
    files = modules()
    known = set(files)
    top, lazy = {m: set() for m in known}, {m: set() for m in known}

    def visit(node, module, package, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # never runs
            deferred = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in _imported(child, package, known):
                    if module.partition(".")[0] != LAB and name.partition(".")[0] == LAB:
                        name = LAB
                    if name != module:
                        (lazy if deferred else top)[module].add(name)
            visit(child, module, package, deferred)

    for module, path in files.items():
        package = ["modeling_weaver", *(module.split(".") if module else ())]
        if path.name != "__init__.py":
            package.pop()
        visit(ast.parse(path.read_text()), module, package, False)
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
        "    importlib.import_module(f'modeling_weaver.{name}')\n"
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
    core = ["", *core_modules()]
    assert not [m for m in core if LAB in top[m]]
    assert [m for m in core if LAB in lazy[m]] == ["cli"]


def test_core_import_graph_has_no_cycles():
    top, lazy = import_edges()
    core = ["", *core_modules()]
    graph = {m: top[m] - {LAB} for m in core}
    lazy = {m: lazy[m] - {LAB} for m in core}
    assert _cycle(graph) is None, f"module-level import cycle: {' -> '.join(_cycle(graph))}"
    full = {m: graph[m] | lazy[m] for m in graph}
    closing = {(a, b) for a in lazy for b in lazy[a] if _reaches(full, b, a)}
    known = set(LAZY_BACK_EDGES)
    assert closing <= known, f"function-level imports closing a cycle: {sorted(closing - known)}"
    assert known <= closing, f"no longer cycles, drop from LAZY_BACK_EDGES: {sorted(known - closing)}"


def test_lab_module_level_imports_have_no_cycles():
    top, _ = import_edges()
    graph = {m: {n for n in top[m] if n.startswith(f"{LAB}.")} for m in top if m.startswith(f"{LAB}.")}
    assert _cycle(graph) is None, f"module-level import cycle in the lab: {' -> '.join(_cycle(graph))}"


def test_the_loop_stays_short():
    """One step read top to bottom: ``_decode`` (signature, docstring and body) stays within 50 lines; setup that
    grows belongs in the factory (``plan_steps``) or a helper."""
    tree = ast.parse((ROOT / "modeling_weaver" / "decoding" / "loop.py").read_text())
    (decode,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_decode"]
    first = min([decode.lineno, *(d.lineno for d in decode.decorator_list)])
    assert decode.end_lineno - first + 1 <= 50, decode.end_lineno - first + 1
