"""Pluggable FLOP estimators; each returns a FlopReport. See base.py for the protocol and the registry."""
from .base import Estimator, EstimatorError, available, get_estimator, register_estimator

__all__ = ["Estimator", "EstimatorError", "available", "get_estimator", "register_estimator"]
