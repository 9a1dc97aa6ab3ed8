"""trinity-train: PyTorch-native pretraining of Trinity-style Mixture-of-Experts models."""

__version__ = "0.1.0"
