"""The skip ledger shared by the stability code and the loader."""

import pytest

from trinity_train.data import DataError, SkipLedger


def test_round_trip_and_lookup(tmp_path):
    path = tmp_path / "run" / "skip_ledger.json"
    ledger = SkipLedger.load(path)
    assert ledger.ranges == [] and not path.exists()
    ledger.add(10, 20, "spike at 21")
    ledger.add(15, 25, "overlapping")
    ledger.add(25, 30, "adjacent")
    ledger.add(40, 41, "one batch")
    ledger.save()
    assert [p.name for p in path.parent.iterdir()] == ["skip_ledger.json"]  # no temp file left
    again = SkipLedger.load(path)
    assert [(r.start, r.end, r.reason) for r in again.ranges][0] == (10, 20, "spike at 21")
    assert [i for i in range(45) if again.contains(i)] == list(range(10, 30)) + [40]
    assert again.next_allowed(12) == 30 and again.next_allowed(40) == 41 and again.next_allowed(5) == 5


def test_bad_ranges_and_bad_files(tmp_path):
    ledger = SkipLedger.load(tmp_path / "l.json")
    with pytest.raises(ValueError):
        ledger.add(5, 5)
    with pytest.raises(ValueError, match="start < end"):
        SkipLedger.from_ranges([[3, 1]], "config")
    with pytest.raises(ValueError, match="no file"):
        SkipLedger.from_ranges([[1, 3]], "config").save()
    (tmp_path / "l.json").write_text("{not json")
    with pytest.raises(DataError, match="l.json"):
        SkipLedger.load(tmp_path / "l.json")
