"""The Trinity MoE model: plain single-device PyTorch (DESIGN §3).

The names below are imported on first use, so that the package's torch-free parts
(`model.alignment`) can be read without importing torch (the launchers' preflight)."""

__all__ = ["ModelOutput", "TrinityModel", "build_model"]


def __getattr__(name: str):
    if name in __all__:
        from trinity_train.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'trinity_train.model' has no attribute '{name}'")
