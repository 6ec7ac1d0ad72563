"""Thin scripts that reproduce the toolkit's results: a configuration and a call into the library."""
