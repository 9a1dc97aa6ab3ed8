"""The GPU table and custom GPUs (plan/hardware.py)."""

import pytest

from trinity_train.plan.hardware import GIB, GPUS, Reserve, custom_hardware, hardware_named


def test_named_gpus_any_case():
    assert hardware_named("H100") is GPUS["h100"]
    assert GPUS["b300"].inter_bytes_s == 800e9 / 8
    with pytest.raises(ValueError, match="unknown GPU"):
        hardware_named("a100")


def test_custom_values_and_their_units():
    hw = custom_hardware(96, 1000, 450, 400)
    assert hw.memory_bytes == 96 * GIB and hw.intra_bytes_s == 450e9
    with pytest.raises(ValueError, match="--peak-tflops"):
        custom_hardware(96, 0, 450, 400)


def test_reserve_grows_with_communicators():
    r = Reserve()
    assert r.total(10 * GIB, 4) - r.total(10 * GIB, 2) == 2 * r.nccl_bytes_per_communicator
