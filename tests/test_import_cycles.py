"""Imports run one way: no import cycle among ``qerl_trl``'s files, function-local and lazy imports included, and
nothing in the library imports ``cli.py`` (it only parses arguments and calls the library).

The graph is read from the source with ``ast`` (no module is imported), so an import inside a function counts as
much as one at the top: both run. Edges:

- ``import a.b`` and ``from a.b import name`` -> ``a.b`` (a package's ``__init__.py`` is a node of its own);
- ``from a import b`` where ``a.b`` is a module -> ``a.b`` only: a submodule's package is already being imported
  when the submodule runs, so ``from . import sibling`` ties the file to the sibling, not to the package;
- ``importlib.import_module("qerl_trl.x")`` and a module-level dict of module names (the lazy ``__getattr__`` of
  ``qerl_trl/__init__.py``) -> those modules.
"""

from __future__ import annotations

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "qerl_trl"


def package_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under the package directory ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The longest module of the package that ``name`` is or lies in (``qerl_trl.x.Cls`` -> ``qerl_trl.x``)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _module_strings(tree: ast.Module) -> list[str]:
    """Module names a file imports by string: ``import_module("...")`` calls and module-level dicts of names."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                out.append(str(node.args[0].value))
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            values = node.value.values
            if values and all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in values):
                out += [v.value for v in values]
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in the file)."""
    mods = package_modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        targets: list[str] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here[: len(here) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
        targets += [s for s in _module_strings(tree) if s.split(".")[0] == root.name]
        for target in targets:
            owner = _owner(target, mods) if target.split(".")[0] == root.name else None
            if owner is not None and owner != mod:
                graph[mod].add(owner)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_qerl_trl_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert {"qerl_trl", "qerl_trl.cli", "qerl_trl.trainer.grpo_trainer"} <= set(graph) and len(graph) > 30
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (break each by moving the shared code into a module both import):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_nothing_in_the_library_imports_the_cli():
    graph = import_graph(PACKAGE)
    users = sorted(m for m, targets in graph.items() if "qerl_trl.cli" in targets)
    assert not users, f"{users} import qerl_trl.cli: move what they need into the library and call it from cli.py"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_check_sees_function_local_and_lazy_imports(tmp_path):
    """The graph builder itself: a cycle closed only inside a function, or through a lazy name table, is found;
    ``from . import sibling`` and a package re-exporting its own modules are not cycles."""
    pkg = _write(tmp_path / "a", {
        "pkg/__init__.py": "from .core import run\n_LAZY = {'Thing': 'pkg.sub.thing'}\n",
        "pkg/core.py": "from . import util\n\ndef run():\n    from .sub.thing import Thing\n    return Thing\n",
        "pkg/util.py": "X = 1\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/thing.py": "from .. import util\n\ndef later():\n    from ..core import run\n    return run\n",
    })  # fmt: skip
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.core", "pkg.sub.thing"}
    assert graph["pkg.sub.thing"] == {"pkg.util", "pkg.core"}
    assert import_cycles(graph) == [["pkg.core", "pkg.sub.thing"]]

    clean = _write(tmp_path / "b", {
        "pkg/__init__.py": "from .core import run\n",
        "pkg/core.py": "from . import util\n\ndef run():\n    from .util import X\n    return X\n",
        "pkg/util.py": "import importlib\n\ndef load():\n    return importlib.import_module('pkg.leaf')\n",
        "pkg/leaf.py": "from .util import load\n",
    })  # fmt: skip
    graph = import_graph(clean)
    assert graph["pkg.core"] == {"pkg.util"}  # not the package it lies in
    assert graph["pkg.util"] == {"pkg.leaf"} and graph["pkg.leaf"] == {"pkg.util"}
    assert import_cycles(graph) == [["pkg.leaf", "pkg.util"]]
    (tmp_path / "b" / "pkg" / "leaf.py").write_text("X = 2\n")
    assert import_cycles(import_graph(clean)) == []
