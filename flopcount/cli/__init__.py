"""The ``flopcount`` command line; see ``main`` for the commands and the exit codes."""
from flopcount.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
