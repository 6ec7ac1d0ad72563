"""Formulas: conv (being written)."""
