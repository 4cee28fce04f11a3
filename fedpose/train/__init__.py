"""Training: the shared step loop, evaluation (PCKh), optimizer/schedule, central runs."""

from fedpose.train.evaluate import evaluate, predict
from fedpose.train.loop import train_steps
from fedpose.train.optim import build_optimizer, build_scheduler

__all__ = ["build_optimizer", "build_scheduler", "evaluate", "predict", "train_steps"]
