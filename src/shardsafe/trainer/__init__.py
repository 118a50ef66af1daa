"""The trainer: ``TrainingModule``, ``Trainer`` and the pieces they are built from."""

from __future__ import annotations

from .config import TrainerConfig
from .loop import FitResult
from .module import TrainingModule
from .trainer import Trainer

__all__ = ["FitResult", "Trainer", "TrainerConfig", "TrainingModule"]
