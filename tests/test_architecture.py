"""The layering of embcache/ and dlrm/ (docs/design.md, "Architecture"): no two modules
import each other, directly or through others, and no module imports or reads another
module's private names, its module-level ones or its objects' private attributes. Imports are
read from the source (inside functions too), so a circle hidden in a function-level import is
found as well."""

from __future__ import annotations

import ast
import re
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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _private_members(tree: ast.Module) -> set[str]:
    """The private attributes a module gives its objects: ``def _x`` (a method, or a function),
    ``self._x = ...`` / ``cls._x = ...``, and ``_x = ...`` in a class body."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if _is_self(node.value):
                found.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign):
                    targets = stmt.targets
                elif isinstance(stmt, ast.AnnAssign):
                    targets = [stmt.target]
                else:
                    continue
                found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {n for n in found if _private(n)}


def _private_attribute_uses(
    name: str, tree: ast.Module, modules, members: dict[str, set[str]]
) -> list[str]:
    """Every ``x._a`` in module ``name`` (``x`` anything but ``self`` or ``cls``) where ``_a``
    is another module's private attribute: ``members`` (each module's
    :func:`_private_members`) has ``_a`` in a module M other than this one, and either this
    module defines no ``_a`` of its own or it imports M (so ``x`` may well be M's object). Names
    no module here defines (torch's, TorchRec's privates) are not looked at."""
    imported = {m for m, _ in _imports(name, tree, modules)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)) or _is_self(node.value):
            continue
        owners = {m for m, attrs in members.items() if m != name and node.attr in attrs}
        if node.attr in members.get(name, ()):
            owners &= imported
        found += [
            f"{name} line {node.lineno} reads {m}'s {ast.unparse(node)}" for m in sorted(owners)
        ]
    return found


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
    members = {name: _private_members(tree) for name, tree in modules.items()}
    found = []
    for name, tree in modules.items():
        found += _private_attribute_uses(name, tree, modules, members)
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
    """The walkers see a circle through a function-level import, a private import, and a
    read of another module's object's private attribute (also where the reading module has
    an attribute of that name of its own, as trainer.py once read its scaler's ``_state``)."""
    a = ast.parse("def f():\n    from dlrm import b\n")
    b = ast.parse("from dlrm.a import _hidden\n")
    modules = {"dlrm.a": a, "dlrm.b": b}
    assert _imports("dlrm.a", a, modules) == [("dlrm.b", None)]
    assert _imports("dlrm.b", b, modules) == [("dlrm.a", "_hidden")]

    owner = ast.parse("class S:\n    _state = ()\n    def _load(self):\n        self._n = 1\n")
    reader = ast.parse(
        "from dlrm.s import S\n"
        "class T:\n"
        "    def __init__(self):\n"
        "        self._state = {}\n"  # its own _state, and its own reads of it
        "        self.s = S()\n"
        "    def f(self, other):\n"
        "        return self._state, self.s._state, other._n, other._load, other._mine\n"
    )
    apart = ast.parse(  # defines _state too, and imports nothing of dlrm.s: its own
        "class U:\n    _state = 0\n    def f(self, other):\n        return other._state\n"
    )
    modules = {"dlrm.s": owner, "dlrm.t": reader, "dlrm.u": apart}
    members = {name: _private_members(tree) for name, tree in modules.items()}
    assert members == {
        "dlrm.s": {"_state", "_load", "_n"},
        "dlrm.t": {"_state"},
        "dlrm.u": {"_state"},
    }
    reads = _private_attribute_uses("dlrm.t", reader, modules, members)
    assert reads == [
        "dlrm.t line 7 reads dlrm.s's self.s._state",
        "dlrm.t line 7 reads dlrm.s's other._n",
        "dlrm.t line 7 reads dlrm.s's other._load",
    ]
    assert _private_attribute_uses("dlrm.u", apart, modules, members) == []


def _design_layers() -> dict[str, int]:
    """Each module's layer as docs/design.md draws it ("Architecture"): dlrm's list, bottom to
    top, layers apart by ';' (files of one layer by ','; parentheses describe); embcache's
    table rows "Python tables" then "around them", a layer each. A folder (``data/``) is a
    layer of all its modules."""
    text = (ROOT / "docs" / "design.md").read_text()
    layers: dict[str, int] = {}
    start = text.index("**dlrm** (the program), bottom to top")
    listing = text[text.index(":", start) + 1 : text.index("\n\n", start)]
    while "(" in listing:  # descriptions (which name files of their own), innermost first
        listing = re.sub(r"\([^()]*\)", "", listing)
    for level, part in enumerate(listing.split(";")):
        for name in part.split("`")[1::2]:
            layers["dlrm." + name.removesuffix(".py").removesuffix("/")] = level
    for level, row in enumerate(("| Python tables |", "| around them |")):
        line = text[text.index(row) : text.index("\n", text.index(row))]
        for name in line.split("`")[1::2]:
            if name.endswith(".py"):
                layers["embcache." + name.removesuffix(".py")] = level
    return layers


def _layer(module: str, layers: dict[str, int]) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in layers:
            return layers[".".join(parts[:n])]
    return None


def test_every_module_imports_only_the_layers_below_it_as_design_md_draws_them():
    """docs/design.md's drawing is the truth: every module of dlrm and embcache has its
    layer there, and imports (function-level ones too) only from its own layer and those
    below it."""
    modules = _modules()
    layers = _design_layers()
    assert len(set(layers.values())) > 10  # the listing was read
    unplaced = [
        name
        for name in modules
        if not _is_package(name) and name != "embcache._C" and _layer(name, layers) is None
    ]
    assert not unplaced, f"modules docs/design.md does not place: {unplaced}"
    upward = []
    for name, tree in modules.items():
        if _is_package(name):
            continue
        mine = _layer(name, layers)
        for imported, _ in _imports(name, tree, modules):
            if imported.split(".")[0] != name.split(".")[0] or _is_package(imported):
                continue
            theirs = _layer(imported, layers)
            if theirs is not None and theirs > mine:
                upward.append(f"{name} imports {imported}")
    assert not upward, "imports from a layer above: " + "; ".join(sorted(upward))
