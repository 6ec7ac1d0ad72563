"""Pluggable FLOP estimators: each answers a Request with a FlopReport. The protocol and the registry: base.py."""
from flopcount.estimators.base import (Capabilities, Estimator, EstimatorError, Request, available, check, get_estimator,
                   register_estimator, run)

__all__ = ["Capabilities", "Estimator", "EstimatorError", "Request", "available", "check", "get_estimator",
           "register_estimator", "run"]
