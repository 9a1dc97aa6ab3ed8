"""Checkpoints: DCP save/load (optionally async), atomic commit, retention, resume, verification."""

from trinity_train.checkpoint.manager import CheckpointManager, load_checkpoint
from trinity_train.checkpoint.model_only import load_model_checkpoint, save_model_checkpoint
from trinity_train.checkpoint.stateful import ModelState, OptimizerState, RNGState
from trinity_train.checkpoint.verify import inspect_checkpoint, verify_checkpoint

__all__ = [
    "CheckpointManager",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "inspect_checkpoint",
    "load_checkpoint",
    "load_model_checkpoint",
    "save_model_checkpoint",
    "verify_checkpoint",
]
