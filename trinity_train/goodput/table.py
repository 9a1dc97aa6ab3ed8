"""The goodput account as text: one row per category (seconds and % of wall, the total and each
attempt), the goodput, and each attempt's host and how it ended."""

from __future__ import annotations

from trinity_train.goodput.account import CATEGORIES, GoodputAccount

LABELS = {
    "startup": "start-up", "productive": "steps kept", "undone": "steps undone", "skipped": "steps skipped",
    "checkpoint": "checkpoint saves", "rollback": "rollback restores", "validation": "validation",
    "statistics": "rank statistics", "data": "data waits", "shutdown": "shutdown", "lost": "lost to failures",
}


def format_table(account: GoodputAccount) -> str:
    attempts = account.attempts
    width = max(len(label) for label in LABELS.values())
    head = f"{'':{width}}  {'total s':>9} {'% wall':>7}" + "".join(f" {f'#{a.index}':>8}" for a in attempts)
    lines = [head]
    for name in CATEGORIES:
        seconds = account.seconds[name]
        share = 100 * seconds / account.wall if account.wall > 0 else 0.0
        lines.append(f"{LABELS[name]:{width}}  {seconds:9.1f} {share:6.1f}%"
                     + "".join(f" {a.seconds[name]:8.1f}" for a in attempts))
    lines.append(f"{'wall':{width}}  {account.wall:9.1f} {100.0:6.1f}%" + "".join(f" {a.wall:8.1f}" for a in attempts))
    steps = account.steps
    lines.append(f"goodput {100 * account.goodput:.1f}% (steps kept / wall); iterations: {steps['productive']} kept, "
                 f"{steps['undone']} undone, {steps['skipped']} skipped; {len(attempts)} attempt(s)")
    for a in attempts:
        ended = a.status or "killed or lost (no end record)"
        lines.append(f"  #{a.index}: {a.host} pid {a.pid}, {a.devices} device(s), from iteration {a.start_iter}, {ended}")
    return "\n".join(lines)
