"""The architecture, enforced: a vLLM-free core beneath a thin vLLM layer.

- nothing in `vllm_kvevict.core` imports vLLM, the vLLM layer (`integration`,
  `patches`) or the tooling (`eval`, `calibrate`, `demo`, `models`), not even
  inside a function;
- every core module imports while `vllm` cannot be imported at all;
- the project's import graph has no cycles, imports inside functions included;
- no module outside `vllm_kvevict.eval` imports the harness;
- a file over 400 lines says in its docstring why it is one file.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> package name (pyproject's package-dir maps two of them)
SOURCES = {"vllm_kvevict": "vllm_kvevict", "patches": "vllm_kvevict.patches",
           "triton_kernels": "vllm_kvevict.triton_kernels"}
TOOLING = ("vllm_kvevict.eval", "vllm_kvevict.calibrate", "vllm_kvevict.demo",
           "vllm_kvevict.models", "vllm_kvevict.passages", "vllm_kvevict.inprocess",
           "vllm_kvevict.probe")
VLLM_LAYER = ("vllm_kvevict.integration", "vllm_kvevict.patches")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in SOURCES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path, module_level_only: bool) -> set[str]:
    """Absolute names this module imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            # `from package import module` imports that module too
            found.update(f"{target}.{a.name}" for a in node.names
                         if f"{target}.{a.name}" in MODULES)
    return found


def _project(names: set[str]) -> set[str]:
    return {n for n in names if n in MODULES}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


CORE = sorted(n for n in MODULES if _within(n, ("vllm_kvevict.core",)))


def test_core_is_what_the_docs_say():
    assert len(CORE) >= 15  # the split happened; a rename must update this test


def test_core_imports_no_vllm_layer_or_tooling():
    bad = {}
    for name in CORE:
        for target in _imports(name, MODULES[name], module_level_only=False):
            if (target == "vllm" or target.startswith("vllm.")
                    or _within(target, VLLM_LAYER + TOOLING)):
                bad.setdefault(name, []).append(target)
    assert not bad, f"core modules importing vLLM, its layer or tooling: {bad}"


def test_core_imports_without_vllm():
    """Every core module imports in a fresh interpreter where `import vllm` fails."""
    code = (
        "import importlib, sys\n"
        "class NoVLLM:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ImportError('vllm is not importable in this test')\n"
        "sys.meta_path.insert(0, NoVLLM())\n"
        f"for m in {CORE!r}:\n"
        "    importlib.import_module(m)\n"
        "assert not any(k == 'vllm' or k.startswith('vllm.') for k in sys.modules)\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        for t in sorted(graph[n]):
            if t not in index:
                visit(t)
                low[n] = min(low[n], low[t])
            elif t in stack:
                low[n] = min(low[n], index[t])
        if low[n] == index[n]:
            members = stack[stack.index(n):]
            del stack[stack.index(n):]
            if len(members) > 1:
                out.append(frozenset(members))

    for n in sorted(graph):
        if n not in index:
            visit(n)
    return out


def test_no_import_cycles():
    """No cycle in the whole tree, counting imports inside functions too: a
    deferred import is still a dependency (the eval harness had plots.py and
    report.py import each other that way)."""
    graph = {n: _project(_imports(n, p, module_level_only=False)) - {n}
             for n, p in MODULES.items()}
    # A package's __init__ importing its own submodules is not a cycle of design.
    for n in graph:
        graph[n] = {t for t in graph[n] if not t.startswith(n + ".")}
    found = set(_cycles(graph))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_product_does_not_import_the_harness():
    """Only the fidelity harness itself imports `vllm_kvevict.eval` (not even
    inside a function): the plugin, its commands (calibrate, demo, models) and
    the kernels work without it."""
    bad = sorted(f"{name} -> {target}" for name, path in MODULES.items()
                 if not _within(name, ("vllm_kvevict.eval",))
                 for target in _imports(name, path, module_level_only=False)
                 if _within(target, ("vllm_kvevict.eval",)))
    assert not bad, bad


def test_long_files_say_why():
    unexplained = []
    for name, path in sorted(MODULES.items()):
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and "One file because" not in doc:
            unexplained.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not unexplained, ("files over %d lines whose docstring does not say why "
                             "('One file because ...'): %s" % (MAX_LINES, unexplained))


def test_config_parsed_in_one_place():
    """`EvictionConfig.from_dict` is called by integration/settings.py only (and
    by the tests): every other reader gets the parsed, frozen value."""
    callers = []
    for name, path in sorted(MODULES.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_dict"):
                callers.append(name)
    assert callers == ["vllm_kvevict.integration.settings"], callers


def test_private_vllm_names_outside_patches_are_in_the_ledger():
    """A private attribute of a vLLM object used in the vLLM layer (read, called
    or stamped; `self._x` of our own classes aside) is listed in the ledger of
    patches/__init__.py with its reason."""
    ledger = MODULES["vllm_kvevict.patches"].read_text()
    own = {"_flag", "_parse", "_number", "_check"}  # our own helpers, reached via modules
    missing = set()
    for name, path in MODULES.items():
        if not _within(name, ("vllm_kvevict.integration",)):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in own
                    and not (isinstance(node.value, ast.Name)
                             and node.value.id in ("self", "cls", "state", "worker"))
                    and node.attr not in ledger):
                missing.add(f"{path.relative_to(ROOT)}: .{node.attr}")
    assert not missing, sorted(missing)
