"""The package's import graph has no circle, and no module imports another's private names.

Every import counts, the ones inside functions too (a deferred import hides a circle; it does not cut it); only
``if TYPE_CHECKING:`` blocks, which never run, are left out."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flopcount"


def _modules() -> dict:
    """{dotted name: (file, is a package's __init__)} of every module of the package."""
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (f, is_init)
    return out


def _is_type_checking(node) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree):
    """Every Import / ImportFrom node outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if not _is_type_checking(child):
                stack.append(child)


def _graph():
    """({module: set of flopcount modules it imports}, [(importer, module, private name)])."""
    mods = _modules()
    edges, private = {}, []
    for name, (path, is_init) in mods.items():
        here = name.split(".") if is_init else name.split(".")[:-1]
        out = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in mods)
                continue
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            if base not in mods:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in mods:
                    out.add(sub)
                    continue
                out.add(base)
                if alias.name.startswith("_") and not alias.name.endswith("__"):
                    private.append((name, base, alias.name))
        out.discard(name)
        edges[name] = out
    return edges, private


def _circles(edges: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_walker_sees_a_circle_through_a_deferred_import():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    from . import b\nif TYPE_CHECKING:\n    from . import c\n")
    assert [n.names[0].name for n in _imports(tree)] == ["b"]


def test_no_import_circle_in_the_package():
    edges, _ = _graph()
    assert len(edges) > 100 and "flopcount.profiles.nsys_export" in edges  # the walk found the package
    assert _circles(edges) == []


def test_no_private_name_is_imported_from_another_module():
    _, private = _graph()
    assert private == []


def test_the_bottom_layers_import_nothing_above_them():
    """formulas and errors are the floor every other module stands on (the design's dependency direction)."""
    edges, _ = _graph()
    floor = {m for m in edges if m == "flopcount.base.errors" or m.startswith("flopcount.formulas")}
    above = {m: sorted(e - floor) for m, e in edges.items() if m in floor and e - floor}
    assert above == {}


# The design's dependency direction, bottom first: a module may import its own layer or any layer below it, never
# one above. The package's __init__ (the public face, lazy) and __main__ stand above everything.
LAYERS = [
    ("base", ("flopcount.base", "flopcount.formulas")),
    ("engine, model, device", ("flopcount.counting", "flopcount.model", "flopcount.device")),
    ("peers, profiles, distributed", ("flopcount.estimators", "flopcount.profiles", "flopcount.distributed")),
    ("analyses, recording", ("flopcount.analyses", "flopcount.recording")),
    ("study", ("flopcount.study",)),
    ("cli", ("flopcount.cli",)),
    ("the public face", ("flopcount", "flopcount.__main__")),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer a module belongs to (its longest matching prefix), or None."""
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), i
    return found


def test_every_module_has_a_layer():
    edges, _ = _graph()
    assert [m for m in edges if layer_of(m) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    edges, _ = _graph()
    up = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {d} ({LAYERS[layer_of(d)][0]})"
                for m, deps in edges.items() for d in deps if layer_of(d) > layer_of(m))
    assert up == []


def test_the_top_level_is_a_handful_of_packages():
    top = sorted(p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())
    assert [t for t in top if t.endswith(".py")] == ["__init__.py", "__main__.py"]
    assert len(top) <= 16, top


def test_the_command_modules_import_no_helper_back_from_the_parser():
    """cli/main.py loads each command module by name; a command module importing from cli/main.py would close a
    circle that the import statements alone do not show."""
    edges, _ = _graph()
    back = sorted(m for m, deps in edges.items()
                  if m.startswith("flopcount.cli.") and m != "flopcount.cli.__main__" and "flopcount.cli.main" in deps)
    assert back == []
