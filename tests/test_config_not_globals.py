"""Settings are values, not module globals: what a decoding step reads comes from its arguments
(:class:`~modeling_weaver.options.TreePolicy`, :class:`~modeling_weaver.options.StepOptions`), never from a switch
that someone flips on a module or a class.

Two scans of the source, each shown to fail on a planted violation:
- no ``setattr(`` on a module (``setattr(sys.modules[...], ...)`` or on a name bound by an import) in the package or
  the kernels;
- every module-level name in the step's modules is a constant: an UPPER_CASE name bound to a tuple, frozenset, str,
  float, range, frozen instance or a listed limit, a listed cache or table, or a private function alias; no
  module-level bool / None / int switch and no class-level bool switch on the step's classes.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "modeling_weaver"
KERNELS = ROOT / "kernels" / "weaver_kernels"

#: The modules one step runs through (the lab, CLI, conversion and export are not read by a step).
STEP_MODULES = ["accept.py", "generate.py", "modeling_dflash.py", "modeling_weaver.py", "options.py", "packed.py",
                "target.py", "tree.py", "validation.py", "decoding"]

#: Module-level names that are state by design, each with why: caches keyed by what they cache, and constant tables.
ALLOWED = {
    "_WEIGHT_COPIES": "cache of weights in other forms (draft heads by dtype and int8, gathered DTensors), weak keys",
    "_STATIC_TARGETS": "cache of fixed-shape steps per model, keyed by capacity, tree size and StepOptions",
    "_SCRATCH": "kernels' scratch buffers per device and shape",
    "_PACKED_COPIES": "packed CPU weights kept between generations, per module (weak keys), each following its weight",
    "_SMS": "SM count per device",
    "_BODIES": "each kernel custom op's Python function, filled at import (direct CPU calls, ops._call)",
    "REFUSED": "the refused settings and why (read-only table, README lists it)",
    "_PROCESSOR_SETTING": "processor class name → the refused setting that builds it (read-only table)",
    "INTERPRET": "a kernel module copy's mode, fixed when it is executed (load_interpreted makes interpreted copies)",
    "_VERIFY_CANDIDATES": "autotune configs, read once when the kernel is decorated",
    "_CONFIGS": "autotune configs, read once when the kernel is decorated",
    "DFlashAttention.cache_attends": "what this version of the drafter code supports (older Hub copies lack it)",
}
#: Module-level integer limits: sizes the code cannot exceed, not choices between two behaviours.
LIMITS = {"MAX_TREE_BUDGET", "MAX_NODES", "RESIDENT_MAX_NODES", "NEUMANN_MAX_NODES", "NEUMANN_MAX_DEPTH",
          "NODE_ATTENTION_MAX_ROWS", "DECODE_BV", "DECODE_NORM_BV", "_NEUMANN_PREP_ROWS", "_TARGET_PROGRAMS",
          "RMS_PLAIN", "RMS_GATED", "RMS_OFFSET"}


def step_files(root: Path = PACKAGE) -> list[Path]:
    files = []
    for name in STEP_MODULES:
        path = root / name
        if path.is_dir():
            files += sorted(path.rglob("*.py"))
        elif path.exists():
            files.append(path)
    return files


def _is_constant(name: str, value: ast.expr | None) -> bool:
    """Whether a module-level ``name = value`` is a constant (see the module docstring)."""
    if name in ALLOWED or name in LIMITS or name == "__all__":
        return True
    if value is None:  # an annotation without a value
        return False
    if isinstance(value, ast.Constant):
        if isinstance(value.value, bool) or value.value is None:
            return False  # a switch
        if isinstance(value.value, int):
            return False  # a tunable (a limit goes in LIMITS)
        return name.isupper() or name.startswith("_")  # str / float / bytes
    if isinstance(value, (ast.Tuple, ast.BinOp)):  # tuples (and tuple concatenations) are constants
        return name.lstrip("_").isupper()
    if isinstance(value, ast.Call):
        func = ast.unparse(value.func)
        if func in ("frozenset", "range", "tuple", "TreePolicy", "StepOptions", "TypeVar"):
            return name.lstrip("_").isupper()
        return name.startswith("_") or name.lstrip("_").isupper() and func.split(".")[-1][:1].isupper()
    if isinstance(value, (ast.Name, ast.Attribute)):  # an alias of a function or class
        return True
    if isinstance(value, ast.Lambda):
        return True
    return False  # lists, dicts, sets and the rest: mutable state


def module_switches(path: Path) -> list[str]:
    """``name`` of every module-level assignment in ``path`` that is not a constant, and ``Class.attr`` of every
    class-level bool / None attribute (a switch flipped on the class)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        targets: list[tuple[str, ast.expr | None]] = []
        if isinstance(node, ast.Assign):
            targets = [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = [(node.target.id, node.value)]
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant) and (
                        isinstance(item.value.value, bool)):
                    names = [f"{node.name}.{t.id}" for t in item.targets if isinstance(t, ast.Name)]
                    # (transformers reads its model classes' capability flags: declarations, not switches)
                    found += [n for n in names if n not in ALLOWED and "supports_" not in n]
        found += [name for name, value in targets if not _is_constant(name, value)]
    return found


def module_setattrs(path: Path) -> list[str]:
    """``setattr(`` calls in ``path`` whose first argument is a module: ``sys.modules[...]`` or a name an import
    bound to a module (``import x``, ``from . import x``)."""
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module is None or node.level):
            modules |= {a.asname or a.name for a in node.names if node.module is None}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
            first = node.args[0]
            text = ast.unparse(first)
            if "sys.modules" in text or isinstance(first, ast.Name) and first.id in modules:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def all_sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted(KERNELS.rglob("*.py"))


def test_no_setattr_on_modules():
    found = [hit for path in all_sources() for hit in module_setattrs(path)]
    assert not found, found


def test_the_step_reads_no_module_switches():
    found = {str(path.relative_to(ROOT)): names for path in step_files() if (names := module_switches(path))}
    assert not found, found
    kernels = {str(path.relative_to(ROOT)): names for path in sorted(KERNELS.rglob("*.py"))
               if (names := module_switches(path))}
    assert not kernels, kernels


def test_the_scans_fail_on_planted_violations(tmp_path):
    """The old tree.py switches, a class-level switch (target.py's old ``peel_root``), a mutable module-level list,
    and a ``setattr`` on an imported module are each caught; constants and caches are not."""
    planted = tmp_path / "tree.py"
    planted.write_text(
        "import sys\n"
        "import weaver_kernels\n"
        "from . import tree as tree_module\n"
        "WEAVER_SPINE: bool = True\n"
        "SPINE_ROUNDS: int = 4\n"
        "SPINE_WIDTH: int | None = None\n"
        "CHILDREN_PER_NODE = 8\n"
        "FUSED_NODE_ATTENTION: bool | None = None\n"
        "_CHOICES = []\n"
        "MODES = ('weaver', 'ddtree', 'chain')\n"
        "MAX_TREE_BUDGET = 4096\n"
        "TREE_MEMORY_SHARE = 0.25\n"
        "DEFAULT_POLICY = TreePolicy()\n"
        "_WEIGHT_COPIES: dict = {}\n"
        "class GatedDeltaNetLayerCache:\n"
        "    peel_root = True\n"
        "    block = 16\n"
        "def flip():\n"
        "    setattr(tree_module, 'WEAVER_SPINE', False)\n"
        "    setattr(sys.modules['x'], 'y', 1)\n"
        "    setattr(weaver_kernels, 'node_attention', None)\n"
        "    setattr(object(), 'fine', 1)\n"
    )
    assert module_switches(planted) == ["WEAVER_SPINE", "SPINE_ROUNDS", "SPINE_WIDTH", "CHILDREN_PER_NODE",
                                        "FUSED_NODE_ATTENTION", "_CHOICES", "GatedDeltaNetLayerCache.peel_root"]
    assert [hit.split(": ", 1)[1] for hit in module_setattrs(planted)] == [
        "setattr(tree_module, 'WEAVER_SPINE', False)", "setattr(sys.modules['x'], 'y', 1)",
        "setattr(weaver_kernels, 'node_attention', None)"]
    (tmp_path / "decoding").mkdir()
    (tmp_path / "decoding" / "loop.py").write_text("USE_FUSED = True\n")
    assert {p.name for p in step_files(tmp_path)} == {"tree.py", "loop.py"}
    assert module_switches(tmp_path / "decoding" / "loop.py") == ["USE_FUSED"]
