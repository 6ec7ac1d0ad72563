"""Formulas: pooling (being written)."""
