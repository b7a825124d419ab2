"""What model files are on this machine and how decodekit would hold their weights, read from the files' headers
without loading a weight: `decodekit list --models`.

A GGUF file's matrices of a type kernels/blocks.py keeps are held in its blocks (q4 or q8; a fused q/k/v or gate/up of
both layouts as q8), every other tensor in float32: the default load where decodekit's kernels are built (without
them, or with dtype=, everything is a float). A safetensors checkpoint loads in the dtype its files hold.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModelFiles:
    """One model on disk: `name` (the default model's, a Hub repo id, or a file name), `path`, `file_format` ("GGUF"
    or "safetensors"), `types` ({a GGUF tensor type or a safetensors dtype: tensors}), `file_bytes` (the weights' bytes
    in the files) and `held` ({format: bytes} as the default load holds them: "q4 blocks", "q8 blocks", "float32",
    ...)."""

    name: str
    path: Path
    file_format: str
    types: dict[str, int] = field(default_factory=dict)
    file_bytes: int = 0
    held: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "name": self.name, "path": str(self.path), "format": self.file_format, "types": self.types,
            "file_bytes": self.file_bytes, "held": self.held, "held_bytes": sum(self.held.values()),
        }  # fmt: skip


def gguf_files(path: Path, name: str | None = None) -> ModelFiles:
    """A GGUF file's tensor types, bytes, and what the default load holds (see the module's docstring)."""
    from ..kernels.blocks import BLOCK, KEPT_TYPES, LAYOUTS
    from .gguf_file import kept_layouts
    from .gguf_header import GGUFHeader

    tensors = GGUFHeader(path).tensors
    kept = {t.name: t.tensor_type.name for t in tensors if len(t.shape) == 2 and t.tensor_type.name in KEPT_TYPES}
    layouts = kept_layouts(kept)
    out = ModelFiles(name or path.name, path, "GGUF")
    for t in tensors:
        kind = t.tensor_type.name
        out.types[kind] = out.types.get(kind, 0) + 1
        out.file_bytes += int(t.n_bytes)
        if t.name in layouts:
            held, size = f"{layouts[t.name]} blocks", LAYOUTS[layouts[t.name]][1] * int(t.n_elements) // BLOCK
        else:
            held, size = "float32", 4 * int(t.n_elements)
        out.held[held] = out.held.get(held, 0) + size
    return out


def safetensors_files(directory: Path, name: str | None = None) -> ModelFiles:
    """A checkpoint folder's safetensors files, from their JSON headers: dtypes, bytes; held as they are."""
    out = ModelFiles(name or directory.name, directory, "safetensors")
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            dtype = entry["dtype"]
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            out.types[dtype] = out.types.get(dtype, 0) + 1
            out.file_bytes += size
            held = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(dtype, dtype.lower())
            out.held[held] = out.held.get(held, 0) + size
    return out


def local_models() -> list[ModelFiles]:
    """The embedded default model (where installed) and every model in the Hugging Face cache with GGUF or
    safetensors weights (a row per GGUF file, one per safetensors snapshot). An unreadable file is left out."""
    out = []
    try:
        from .default import DEFAULT_MODEL_NAME, default_model_path

        out.append(gguf_files(default_model_path(), f"{DEFAULT_MODEL_NAME} (default)"))
    except Exception:  # not installed: nothing to list for it
        pass
    for repo_id, snapshot in _cached_snapshots():
        for file in sorted(snapshot.glob("*.gguf")):
            try:
                out.append(gguf_files(file, f"{repo_id}/{file.name}"))
            except Exception:  # a partial or foreign file: not a model to offer
                continue
        if any(snapshot.glob("*.safetensors")) and (snapshot / "config.json").is_file():
            try:
                out.append(safetensors_files(snapshot, repo_id))
            except (OSError, ValueError, KeyError, struct.error):
                continue
    return out


def _cached_snapshots() -> list[tuple[str, Path]]:
    try:
        from huggingface_hub import constants, scan_cache_dir

        cache = scan_cache_dir(constants.HF_HUB_CACHE)
    except Exception:  # no cache yet, or an unreadable one
        return []
    return [
        (repo.repo_id, Path(rev.snapshot_path))
        for repo in sorted(cache.repos, key=lambda r: r.repo_id)
        if repo.repo_type == "model"
        for rev in repo.revisions
    ]


def render_models(models: list[ModelFiles]) -> str:
    """A table: name, the file's types, its weights' bytes, and what the default load holds."""
    if not models:
        return "No model files here: the default model is not installed and the Hugging Face cache holds none."
    rows = [("MODEL", "FILE", "FILE BYTES", "HELD AS", "HELD BYTES")]
    for m in models:
        types = ", ".join(f"{k} x{n}" for k, n in sorted(m.types.items(), key=lambda kv: -kv[1]))
        held = ", ".join(f"{k} {_size(v)}" for k, v in sorted(m.held.items(), key=lambda kv: -kv[1]))
        rows.append((m.name, f"{m.file_format}: {types}", _size(m.file_bytes), held, _size(sum(m.held.values()))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
