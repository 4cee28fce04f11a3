"""Evaluation metrics (PCKh)."""

from fedpose.eval.pckh import PCKH_KEYS, pckh, pckh_per_joint

__all__ = ["PCKH_KEYS", "pckh", "pckh_per_joint"]
