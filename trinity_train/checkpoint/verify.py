"""`trinity-train ckpt inspect|verify`: describe a checkpoint, and prove it complete and loadable.

Verification goes from cheap to thorough: meta.json and config, DCP metadata, every data file
present and long enough for the byte ranges the metadata points at, then every item actually
read back (one component at a time, so memory stays bounded by the largest component) and the
model's floating-point tensors checked for NaN/Inf.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trinity_train.checkpoint import dcp_io
from trinity_train.checkpoint.compat import config_from_meta
from trinity_train.checkpoint.layout import read_meta
from trinity_train.errors import CheckpointError


def _read_dcp_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # any unpickling/IO failure means the same thing to the user
        raise CheckpointError(f"checkpoint '{path}' has an unreadable DCP .metadata file: {e}") from None


def _component(fqn: str) -> str:
    return fqn.split(".", 1)[0]


def _tensor_bytes(md: TensorStorageMetadata) -> int:
    return md.size.numel() * torch.empty((), dtype=md.properties.dtype).element_size()


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """A summary: kind, step, model shape, and per component its tensor count and bytes."""
    path = Path(path)
    meta = read_meta(path)
    cfg = config_from_meta(meta, path)
    dcp_meta = _read_dcp_metadata(path)
    components: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "objects": 0})
    for fqn, md in dcp_meta.state_dict_metadata.items():
        entry = components[_component(fqn)]
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
    }


def _check_files(path: Path, dcp_meta: Metadata) -> None:
    needed: dict[str, int] = defaultdict(int)
    for info in (dcp_meta.storage_data or {}).values():
        needed[info.relative_path] = max(needed[info.relative_path], info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint '{path}' is incomplete: data file '{name}' is missing")
        if file.stat().st_size < end:
            raise CheckpointError(f"checkpoint '{path}' is truncated: '{name}' has {file.stat().st_size} "
                                  f"bytes, the metadata needs {end}")


def _empty_like_metadata(md: Any) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None  # a pickled object; DCP replaces the placeholder with what it reads


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Raise CheckpointError on the first problem; return the inspect summary when all is well."""
    path = Path(path)
    summary = inspect_checkpoint(path)
    dcp_meta = _read_dcp_metadata(path)
    saved = set(summary["components"])
    missing = sorted(set(read_meta(path).get("components", [])) - saved)
    if missing:
        raise CheckpointError(f"checkpoint '{path}' is missing components {', '.join(missing)} listed in meta.json")
    _check_files(path, dcp_meta)
    for component in sorted(saved):
        template = {fqn: _empty_like_metadata(md) for fqn, md in dcp_meta.state_dict_metadata.items()
                    if _component(fqn) == component}
        dcp_io.load(template, path)
        if component == "model":
            bad = [fqn for fqn, t in template.items()
                   if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all()]
            if bad:
                raise CheckpointError(f"checkpoint '{path}' has non-finite values in {len(bad)} model "
                                      f"tensor(s), first {bad[0]}")
    return summary
