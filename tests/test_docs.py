"""The documentation: every command example of the README and the docs pages runs, the site builds strict, and the
README stays short and links to pages that exist.

One convention for command examples: a ```console block holds runnable examples, each a line `$ flopcount ...`
(a trailing backslash continues it), followed by what it prints. Examples that cannot run here (a GPU, a Dask
cluster, the full study, a count of minutes) are in ```text blocks, which are not run. No line of a ```bash block
(or of a block with no language) starts with a flopcount command, so no example escapes both rules."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
COMMAND = re.compile(r"^(\$ )?flopcount ", re.M)


def _blocks():
    """(page, line, language, body) of every fenced block of the README and the docs."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            yield page, text[:m.start()].count("\n") + 1, m.group(1), m.group(2)


def _commands(body: str) -> list:
    """The `$ flopcount ...` command lines of a console block, continuations joined."""
    out, lines = [], body.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ flopcount "):
            cmd = line[2:]
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            out.append(cmd)
        i += 1
    return out


EXAMPLES = [(f"{page.relative_to(ROOT)}:{line}", cmd)
            for page, line, lang, body in _blocks() if lang == "console" for cmd in _commands(body)]


def test_there_are_examples_and_each_command_block_follows_the_convention():
    assert len(EXAMPLES) >= 8  # one per main command in the README, and the guide's
    for page, line, lang, body in _blocks():
        if lang not in ("console", "text") and COMMAND.search(body):
            pytest.fail(f"{page.relative_to(ROOT)}:{line}: a flopcount command in a ```{lang} block: make it "
                        "```console (run by this test) or ```text (not run)")
        if lang == "console":
            assert _commands(body), f"{page.relative_to(ROOT)}:{line}: a console block without `$ flopcount` lines"


@pytest.mark.parametrize("where,command", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_the_example_runs(where, command, monkeypatch, capsys):
    from flopcount.cli.main import main

    monkeypatch.chdir(ROOT)  # the examples' paths (tests/fixtures/...) are relative to the repository
    monkeypatch.setenv("COLUMNS", "120")
    argv = shlex.split(command)
    assert argv[0] == "flopcount"
    code = main(argv[1:])
    captured = capsys.readouterr()
    assert code == 0, f"{where}: `{command}` exited {code}: {captured.err.strip()}"
    assert captured.out.strip(), f"{where}: `{command}` printed nothing"


def test_the_readme_python_example_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_the_readme_is_short_and_its_links_reach_pages_that_exist():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"
    for page in ("index", "conventions", "benchmarks", "layout", "reference/cli", "reference/api"):
        assert f"docs/{page}.md" in text, f"README has no link to docs/{page}.md"


def test_the_site_builds_strict_with_the_generated_pages(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    from flopcount.cli.main import COMMANDS

    for command in COMMANDS:  # every command's --help, generated from the parser
        assert f"usage: flopcount {command}" in cli, command
    assert "<!-- cli-reference -->" not in cli
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    # the public names, each shown under the module that defines it today
    for name in ("count", "FlopReport", "compare", "utilization", "generate_cost", "register_estimator", "analyze"):
        assert re.search(rf'id="flopcount(\.\w+)*\.{name}"', api), name
    formulas = (site / "reference" / "formulas" / "index.html").read_text(encoding="utf-8")
    assert "<!-- formula-table -->" not in formulas


def _hooks():
    """docs/hooks.py, loaded as MkDocs loads it (a file, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flopcount_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_formula_page_is_generated_by_the_listing_where_it_exists_and_says_so_where_not(monkeypatch):
    import types

    hooks = _hooks()
    page = "# Formula table\n\n<!-- formula-table -->\n"
    fake = types.ModuleType("flopcount.formulas.listing")
    fake.markdown = lambda: "| op | FLOPs |\n|---|---|\n| aten.mm | 2mkn |"
    monkeypatch.setitem(sys.modules, "flopcount.formulas.listing", fake)
    assert "| aten.mm | 2mkn |" in hooks.on_page_markdown(page, None, None, None)
    monkeypatch.setitem(sys.modules, "flopcount.formulas.listing", types.ModuleType("flopcount.formulas.listing"))
    out = hooks.on_page_markdown(page, None, None, None)
    assert "no `flopcount.formulas.listing.markdown()` yet" in out and "<!-- formula-table -->" not in out


def test_an_api_entry_by_its_public_name_points_at_the_module_that_defines_it():
    import flopcount

    hooks = _hooks()
    for public in ("flopcount.compare", "flopcount.FlopReport", "flopcount.generate_cost", "flopcount.count"):
        path = hooks.defining_path(public)
        module, _, name = path.rpartition(".")
        assert getattr(sys.modules[module], name) is getattr(flopcount, public.split(".")[-1]), (public, path)
    assert hooks.defining_path("flopcount.profiles") == "flopcount.profiles"  # a module stays as it is written
    page = hooks.on_page_markdown("::: flopcount.compare\n    options:\n      heading_level: 3\n", None, None, None)
    first, rest = page.split("\n", 1)
    assert first == "::: " + hooks.defining_path("flopcount.compare") != "::: flopcount.compare"
    assert rest == "    options:\n      heading_level: 3\n"  # the entry's options are left as written
