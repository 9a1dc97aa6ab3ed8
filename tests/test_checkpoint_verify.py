"""`ckpt inspect|verify`: a good checkpoint passes; each kind of damage is named."""

import pytest
import torch
from torch import nn

from trinity_train.checkpoint import CheckpointManager, ModelState, inspect_checkpoint, verify_checkpoint
from trinity_train.config import CheckpointConfig, Config
from trinity_train.errors import CheckpointError


class Position:
    def state_dict(self):
        return {"position": 12, "name": "train"}

    def load_state_dict(self, sd):
        pass


def saved_checkpoint(tmp_path, fill=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 2))
    if fill is not None:
        with torch.no_grad():
            model[1].bias.fill_(fill)
    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    return mgr.save(9, {"model": ModelState(model), "loader": Position()}, Config())


def test_good_checkpoint_verifies_and_is_described(tmp_path):
    path = saved_checkpoint(tmp_path)
    summary = verify_checkpoint(path)
    assert summary["step"] == 9 and summary["kind"] == "training"
    assert summary["components"]["model"] == {"tensors": 4, "bytes": (4 * 16 + 16 + 16 * 2 + 2) * 4, "objects": 0}
    assert summary["components"]["loader"]["objects"] == 2
    assert inspect_checkpoint(path)["model"]["block"] == "trinity"


def data_file(path):
    (file,) = path.glob("*.distcp")
    return file


def test_truncated_data_file_is_reported(tmp_path):
    path = saved_checkpoint(tmp_path)
    file = data_file(path)
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        verify_checkpoint(path)


def test_missing_data_file_is_reported(tmp_path):
    path = saved_checkpoint(tmp_path)
    data_file(path).unlink()
    with pytest.raises(CheckpointError, match="incomplete.*missing"):
        verify_checkpoint(path)


def test_missing_meta_and_corrupt_metadata_are_reported(tmp_path):
    path = saved_checkpoint(tmp_path)
    (path / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="truncated: '.metadata'"):
        verify_checkpoint(path)
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete: it has no meta.json"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_checkpoint(tmp_path / "missing")


def test_non_finite_weights_fail_verification(tmp_path):
    path = saved_checkpoint(tmp_path, fill=float("nan"))
    with pytest.raises(CheckpointError, match="non-finite values in 1 model tensor"):
        verify_checkpoint(path)
