"""Memory and speed estimators: predictions for a GPU this machine doesn't have."""

from autotune.estimator.base import PARTS, Estimate, Estimator

__all__ = ["PARTS", "Estimate", "Estimator"]
