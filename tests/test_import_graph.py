"""The package's modules import one another one way: no module reaches itself again through its imports, those
inside functions included (an import deferred inside a function hides a circle, it does not remove it). The graph is
read from the source; profiles/ is left out while it is being restructured."""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "flopcount")
LEFT_OUT = ("flopcount.profiles",)


def modules() -> dict:
    """dotted name -> path of every module of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: str, known: dict) -> set:
    """The package's modules that ``name`` imports, anywhere in its source."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            base = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_no_import_circles():
    known = modules()
    kept = {n for n in known if not n.startswith(LEFT_OUT)}
    graph = {n: imports(n, known[n], known) & kept for n in kept}
    circles = []
    state = {}  # name -> "open" while on the path, "done" once every module it reaches was seen

    def visit(name, path):
        state[name] = "open"
        for nxt in sorted(graph[name]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == [], "import circles: " + "; ".join(circles)
