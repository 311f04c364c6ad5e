"""The layering of embcache/ and dlrm/ (docs/design.md, "Architecture"): no two modules
import each other, directly or through others, and no module imports or reads another
module's private names. Imports are read from the source (inside functions too), so a
circle hidden in a function-level import is found as well."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("embcache", "dlrm")


def _modules() -> dict[str, ast.Module]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = ast.parse(path.read_text(), str(path))
    return out


def _is_package(name: str) -> bool:
    return (ROOT / name.replace(".", "/")).is_dir()


def _imports(name: str, tree: ast.Module, modules) -> list[tuple[str, str | None]]:
    """(module, name imported from it or None) for every import of a project module."""
    package = name if _is_package(name) else None
    base = package or name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the package this module is in
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                module = f"{anchor}.{module}" if module else anchor
            for alias in node.names:
                if f"{module}.{alias.name}" in modules:  # a submodule
                    found.append((f"{module}.{alias.name}", None))
                elif module in modules:
                    found.append((module, alias.name))
    return [(m, n) for m, n in found if m != name]


def test_no_module_imports_itself_through_others():
    modules = _modules()
    graph = {name: {m for m, _ in _imports(name, tree, modules)} for name, tree in modules.items()}
    # A package's __init__ gathers its modules' public names; an edge into a package is an
    # edge into whichever of its modules provides the name, so packages are left out.
    packages = {n for n in modules if _is_package(n)}
    graph = {n: edges - packages for n, edges in graph.items() if n not in packages}

    def path_back(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = [path for name in sorted(graph) if (path := path_back(name))]
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_no_module_uses_another_modules_private_names():
    modules = _modules()
    found = []
    for name, tree in modules.items():
        imports = _imports(name, tree, modules)
        found += [
            f"{name} imports {m}.{n}"
            for m, n in imports
            # a package's private submodule (its compiled extension) is the package's own
            if n and n.startswith("_") and not (_is_package(m) and name.startswith(m + "."))
        ]
        # module objects bound by `import a.b as c` / `from a import b`: c._x is private use
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    full = (
                        alias.name
                        if isinstance(node, ast.Import)
                        else f"{node.module}.{alias.name}"
                    )
                    if full in modules:
                        aliases[alias.asname or alias.name.split(".")[0]] = full
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name} reads {aliases[node.value.id]}.{node.attr}")
    assert not found, "; ".join(sorted(set(found)))


def test_the_checks_find_what_they_look_for(tmp_path, monkeypatch):
    """The walkers see a circle through a function-level import and a private import."""
    a = ast.parse("def f():\n    from dlrm import b\n")
    b = ast.parse("from dlrm.a import _hidden\n")
    modules = {"dlrm.a": a, "dlrm.b": b}
    assert _imports("dlrm.a", a, modules) == [("dlrm.b", None)]
    assert _imports("dlrm.b", b, modules) == [("dlrm.a", "_hidden")]
