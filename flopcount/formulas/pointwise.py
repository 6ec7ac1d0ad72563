"""Formulas: pointwise (being written)."""
