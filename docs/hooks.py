"""MkDocs hooks: the pages generated from the code when the site is built.

A page holds a marker where generated text goes; nothing between the markers is written by hand:

- ``<!-- cli-reference -->``: every ``flopcount`` command's ``--help``, from the parser the command line itself builds;
- ``<!-- formula-table -->``: the formula table, from ``flopcount.formulas.listing.markdown()`` where it exists.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_MARKER = "<!-- cli-reference -->"
FORMULAS_MARKER = "<!-- formula-table -->"
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
    try:
        listing = importlib.import_module("flopcount.formulas.listing")
        generate = listing.markdown
    except (ImportError, AttributeError):
        return ("*This flopcount has no `flopcount.formulas.listing.markdown()` yet: the table is generated here "
                "once it does.*")
    return generate()


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs hook: put the generated text in place of each marker on the page."""
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if FORMULAS_MARKER in markdown:
        markdown = markdown.replace(FORMULAS_MARKER, formula_table())
    return markdown
