"""The data section of the config: mixes, phases and skip ranges are checked before any work."""

import pytest

from trinity_train.config import load_config
from trinity_train.errors import ConfigError

MIX = [{"path": "a", "weight": 3.0}, {"path": "b", "weight": 1.0}]


def test_phases_load_from_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[data.mix]]\npath = "a"\nweight = 3\n[[data.mix]]\npath = "b"\n'
                    '[[data.phases]]\nstart_tokens = 1000000\nweights = [0, 1]\n')
    cfg = load_config(path)
    assert cfg.data.phases[0].start_tokens == 1_000_000 and cfg.data.phases[0].weights == [0.0, 1.0]


@pytest.mark.parametrize("data, key", [
    ({"phases": [{"start_tokens": 10, "weights": [1.0]}]}, "data.phases"),
    ({"mix": MIX, "phases": [{"start_tokens": 10, "weights": [1.0]}]}, r"data.phases\[0\].weights"),
    ({"mix": MIX, "phases": [{"start_tokens": 10, "weights": [0.0, 0.0]}]}, r"data.phases\[0\].weights"),
    ({"mix": MIX, "phases": [{"start_tokens": 10, "weights": [1.0, 1.0]},
                             {"start_tokens": 10, "weights": [1.0, 2.0]}]}, r"data.phases\[1\].start_tokens"),
    ({"mix": [{"path": "a", "weight": 0.0}]}, r"data.mix\[0\].weight"),
    ({"skip_ranges": [[5, 5]]}, r"data.skip_ranges\[0\]"),
])
def test_bad_data_settings_name_their_key(data, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, {"data": data})
