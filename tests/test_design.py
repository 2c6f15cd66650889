"""What docs/design.md promises of the code's shape: omlx_cache uses no private
name of mlx-lm, its modules import each other without a circle, the server's
factory does not load the evaluation code, and no class of the patched tree or
of omlx_cache has more than four classes in its MRO."""

import ast
import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import omlx_cache

PACKAGE = Path(omlx_cache.__file__).parent
PACKAGES = {
    ".".join(p.relative_to(PACKAGE.parent).parts)
    for p in [PACKAGE, *PACKAGE.rglob("*")]
    if (p / "__init__.py").exists()
}


def sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        yield name.removesuffix(".__init__"), path, ast.parse(path.read_text())


def imported(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``import from`` names."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if module not in PACKAGES:
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_private_mlx_lm_name():
    private = []
    for module, path, tree in sources():
        mlx_lm_names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "mlx_lm"
            ):
                parts = node.module.split(".")
                names = [a.name for a in node.names]
                private += [
                    f"{module}: from {node.module} import {n}"
                    for n in names
                    if n.startswith("_") or any(p.startswith("_") for p in parts)
                ]
                mlx_lm_names.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("mlx_lm"):
                        mlx_lm_names.add((a.asname or a.name).split(".")[0])
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in mlx_lm_names
                and node.attr.startswith("_")
                and not node.attr.endswith("__")
            ):
                private.append(f"{module}: {node.value.id}.{node.attr}")
    assert not private


def test_no_import_circle():
    trees = {module: tree for module, _, tree in sources()}
    graph = {}
    for module, tree in trees.items():
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = imported(module, node)
                for alias in node.names:
                    # the module a name is, else the module it comes from
                    name = f"{target}.{alias.name}"
                    edges.add(name if name in trees else target)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
        graph[module] = {e for e in edges if e in trees and e != module}

    def reaches(start, goal, seen):
        for nxt in graph[start]:
            if nxt == goal or (
                nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)
            ):
                return True
        return False

    circles = [m for m in sorted(graph) if reaches(m, m, set())]
    assert not circles


def test_the_factory_loads_no_evaluation_code():
    code = (
        "import sys, json, omlx_cache.factory, omlx_cache.kv; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('omlx_cache'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    )
    loaded = json.loads(done.stdout)
    assert "omlx_cache.eval" not in loaded and "omlx_cache.bench" not in loaded


def classes_of(module):
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ == module.__name__:
            yield cls


def test_no_class_has_more_than_four_classes_in_its_mro():
    modules = [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages([str(PACKAGE)], "omlx_cache.")
        if not m.name.endswith("__main__")
    ]
    for name in ("cache", "base"):
        modules.append(importlib.import_module(f"mlx_lm.models.{name}"))
    deep = [
        f"{cls.__module__}.{cls.__name__}: {len(cls.__mro__)}"
        for module in modules
        for cls in classes_of(module)
        if len(cls.__mro__) > 4 and not issubclass(cls, (BaseException, dict, tuple))
    ]
    assert not deep
