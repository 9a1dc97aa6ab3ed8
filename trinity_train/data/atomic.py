"""Write files so they are either complete or absent: write a temporary sibling, then rename."""

from __future__ import annotations

import json
import os
from pathlib import Path


def temp_sibling(path: Path) -> Path:
    """A hidden name next to `path`, unique to this process, that readers never mistake for it."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
