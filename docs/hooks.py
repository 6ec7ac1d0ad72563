"""MkDocs hooks: the pages generated from the code when the site is built.

A page holds a marker where generated text goes; nothing between the markers is written by hand:

- ``<!-- cli-reference -->``: every ``flopcount`` command's ``--help``, from the parser the command line itself builds;
- ``<!-- formula-table -->``: the formula table, from ``flopcount.formulas.listing.markdown()`` where it exists.

And the API pages name objects by their public names (``::: flopcount.compare``): each is looked up in the package
as a user would reach it and handed to mkdocstrings under the module that defines it today, so a module that moves
inside the package does not break the page.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_MARKER = "<!-- cli-reference -->"
FORMULAS_MARKER = "<!-- formula-table -->"
AUTODOC = re.compile(r"^::: (flopcount(?:\.\w+)+)[ \t]*$", re.M)
HELP_WIDTH = "100"  # argparse wraps at $COLUMNS: a fixed width makes the page the same on every machine


def _flopcount_importable() -> None:
    if ROOT not in sys.path:  # the checkout's flopcount, installed or not
        sys.path.insert(0, ROOT)


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    """{name: subparser} of a parser's subcommands, in the order they were added."""
    for action in parser._actions:  # argparse keeps its subparsers in an action with a dict of choices
        if isinstance(getattr(action, "choices", None), dict):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """Markdown for every command: a heading and its ``--help`` text, as the installed command prints it."""
    _flopcount_importable()
    main = importlib.import_module("flopcount.cli.main")
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        parser = main.build_parser()
        parts = ["## flopcount", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in _subcommands(parser).items():
            parts += [f"## flopcount {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(parts)


def formula_table() -> str:
    """The formula table as markdown from ``flopcount.formulas.listing.markdown()``, or a note where that
    generator does not exist yet."""
    _flopcount_importable()
    name = "flopcount.formulas.listing"
    try:
        listing = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:  # the module is there and fails: say so, do not hide it behind the note
            raise
        listing = None
    generate = getattr(listing, "markdown", None)
    if generate is None:
        return ("*This flopcount has no `flopcount.formulas.listing.markdown()` yet: the table is generated here "
                "once it does.*")
    return generate()


def defining_path(public: str) -> str:
    """Where the object a public dotted name reaches is defined (``flopcount.compare`` -> ``flopcount.analyses.compare.compare``);
    a module, or an object that does not say, keeps the name it was given."""
    _flopcount_importable()
    parts = public.split(".")
    obj = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=1):
        if not hasattr(obj, name):  # the attribute of a module shadowed by a function of its name (compare)
            obj = importlib.import_module(".".join(parts[:i]))
        try:
            obj = getattr(obj, name)
        except AttributeError:  # a submodule not loaded yet
            obj = importlib.import_module(".".join(parts[:i + 1]))
    if inspect.ismodule(obj):
        return public
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return public
    return f"{module}.{qualname}"


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs hook: put the generated text in place of each marker on the page, and point each ``::: name`` of the
    API pages at the module that defines the object."""
    markdown = AUTODOC.sub(lambda m: f"::: {defining_path(m.group(1))}", markdown)
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if FORMULAS_MARKER in markdown:
        markdown = markdown.replace(FORMULAS_MARKER, formula_table())
    return markdown
