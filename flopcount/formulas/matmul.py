"""Formulas: matmul (being written)."""
