"""trinity_harness/table.py: the one markdown table every benchmark script ends with (issue 48)."""

from __future__ import annotations

import pytest

from conftest import last_table
from trinity_harness.table import markdown_table, ratio


def test_a_table_has_a_header_a_separator_and_a_row_each_numbers_right_aligned():
    out = markdown_table(["case", "best ms", "ratio"], [["a|b", "1,234.5", ratio(2.0, 1.0)], ["c", None, "-"]])
    assert out.splitlines() == ["| case | best ms | ratio |", "|---|---:|---:|",
                                "| a\\|b | 1,234.5 | 2.00x |", "| c | - | - |"]
    assert last_table("progress\n" + out + "\n") == out.splitlines()


def test_ratio_formats_and_refuses_a_zero_denominator():
    assert ratio(3.0, 2.0) == "1.50x" and ratio(2529.0, 1.0, 0) == "2,529x" and ratio(1.0, 0.0) == "-"


def test_a_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="2 cells under 3 headers"):
        markdown_table(["a", "b", "c"], [[1, 2]])
