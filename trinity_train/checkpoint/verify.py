"""`trinity-train ckpt inspect|verify`: describe a checkpoint, and prove it whole and loadable.

Verification goes from cheap to thorough: `check_integrity` (meta.json and its config, every
file's size and checksum, the DCP metadata and the byte ranges it points at), then every item
actually read back (one component at a time, so memory stays bounded by the largest component)
with the model's floating-point tensors checked for NaN/Inf; `deep` checks every component's
tensors, optimizer state included.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trinity_train.checkpoint.compat import config_from_meta
from trinity_train.checkpoint.integrity import (check_integrity, component_of, read_back, read_dcp_metadata,
                                                require_sound)
from trinity_train.checkpoint.layout import read_meta


def _tensor_bytes(md: TensorStorageMetadata) -> int:
    return md.size.numel() * torch.empty((), dtype=md.properties.dtype).element_size()


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """A summary: kind, step, model shape, and per component its tensor count and bytes, of a
    checkpoint `require_sound` finds whole."""
    path = Path(path)
    require_sound(path)
    meta = read_meta(path)
    cfg = config_from_meta(meta, path)
    dcp_meta = read_dcp_metadata(path)
    components: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "objects": 0})
    for fqn, md in dcp_meta.state_dict_metadata.items():
        entry = components[component_of(fqn)]
        if isinstance(md, TensorStorageMetadata):
            entry["tensors"] += 1
            entry["bytes"] += _tensor_bytes(md)
        else:
            entry["objects"] += 1
    m = cfg.model
    return {
        "path": str(path),
        "kind": meta.get("kind"),
        "step": meta.get("step"),
        "created": meta.get("created"),
        "model": {"block": m.block, "layers": m.num_layers, "hidden_size": m.hidden_size,
                  "experts": m.num_experts, "top_k": m.num_experts_per_tok, "vocab_size": m.vocab_size},
        "components": dict(sorted(components.items())),
        "files_bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        "checksummed_files": len(meta.get("files") or {}),
    }


def verify_checkpoint(path: str | Path, deep: bool = False) -> dict[str, Any]:
    """Raise CheckpointError on the first problem; return the inspect summary when all is well."""
    path = Path(path)
    check_integrity(path)  # before anything reads a possibly damaged .metadata
    summary = inspect_checkpoint(path)
    read_back(path, read_dcp_metadata(path), finite=lambda component: deep or component == "model")
    return summary
