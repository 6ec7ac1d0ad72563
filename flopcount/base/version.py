"""The package's version, in one place (pyproject.toml gives the same)."""
VERSION = "0.1.0"
