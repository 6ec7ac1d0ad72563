"""Every public function and class of the package, and every public method of a public class, has a docstring:
the test lists any without one (a name with a leading underscore is private; dunder methods are Python's)."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "flopcount"


def missing() -> list:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(PACKAGE.parent).as_posix()
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name[0] == "_":
                continue
            if ast.get_docstring(node) is None:
                out.append(f"{where}:{node.lineno} {node.name}")
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if (isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name[0] != "_"
                            and ast.get_docstring(sub) is None):
                        out.append(f"{where}:{sub.lineno} {node.name}.{sub.name}")
    return out


def test_every_public_function_and_class_has_a_docstring():
    gone = missing()
    assert not gone, f"{len(gone)} public functions, classes or methods without a docstring:\n" + "\n".join(gone)
