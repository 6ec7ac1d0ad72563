"""Formulas: reduction (being written)."""
