"""The "Where the time went" panel's payload: the run's goodput account (trinity_train.goodput),
per attempt and in total, with the categories in the order the page stacks them.

The account is recomputed only when timeline.jsonl has grown, so a live page polling a long run
does not re-read it for nothing.
"""

from __future__ import annotations

from trinity_train.dashboard.runs import RunView
from trinity_train.goodput import CATEGORIES, account
from trinity_train.goodput.table import LABELS


def goodput(run: RunView) -> dict:
    """{"categories", "labels", "wall_s", "goodput", "seconds", "steps", "attempts"}; no attempts
    for a run without a timeline (from before it, or not started)."""
    path = run.rundir.timeline
    size = path.stat().st_size if path.is_file() else -1
    with run.lock:
        cached = run.derived.get("goodput")
    if cached is not None and cached[0] == size:
        return cached[1]
    result = account(run.rundir.path)
    payload = {"categories": list(CATEGORIES), "labels": LABELS}
    payload.update(result.to_dict() if result is not None else
                   {"wall_s": 0.0, "goodput": None, "seconds": {}, "steps": {}, "attempts": []})
    with run.lock:
        run.derived["goodput"] = (size, payload)
    return payload
