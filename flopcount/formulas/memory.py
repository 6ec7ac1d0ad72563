"""Formulas: memory (being written)."""
