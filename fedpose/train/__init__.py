"""Training: the shared step loop, evaluation (PCKh), optimizer/schedule, central runs."""

from fedpose.train.evaluate import evaluate, predict
from fedpose.train.loop import DivergenceMonitor, TrainingDiverged, calibrate_batch_norm, train_steps
from fedpose.train.optim import build_optimizer, build_scheduler

__all__ = ["DivergenceMonitor", "TrainingDiverged", "build_optimizer", "build_scheduler", "calibrate_batch_norm", "evaluate", "predict", "train_steps"]
