"""The Trinity MoE model: plain single-device PyTorch (DESIGN §3)."""

from trinity_train.model.transformer import ModelOutput, TrinityModel, build_model

__all__ = ["ModelOutput", "TrinityModel", "build_model"]
