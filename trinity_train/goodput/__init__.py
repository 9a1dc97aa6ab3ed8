"""Goodput: where every second of a run went, across its attempts (issue 17; DESIGN §9).

`account(run_dir)` reads the run's `timeline.jsonl` and returns a `GoodputAccount`: the wall time
from the first attempt's process start to the last record, split into categories that add up to
it, per attempt and in total; `format_table` prints it (`trinity-train goodput RUN_DIR`).
"""

from trinity_train.goodput.account import CATEGORIES, GoodputAccount, account
from trinity_train.goodput.table import format_table

__all__ = ["CATEGORIES", "GoodputAccount", "account", "format_table"]
