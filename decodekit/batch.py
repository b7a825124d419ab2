"""Batch generation over rows of prompts: what `decodekit batch` and the Ray integration run.

A JSON Lines file in, one object per line with a prompt (key "prompt" unless told otherwise) and optionally an
"id"; a JSON Lines file out, each input row with "generated_text" and "generated_token_ids" added. Rows already
in the output (by id; the line number where a row has none) are skipped, so a run that stopped goes on where
it was; a line cut off by a crash is the only thing ever removed from the output. Each prompt is generated on
its own, so a row's output is what generate() gives for that prompt alone, whatever decoding method it uses
(built-in fields, a hook-only method or a full-loop custom_generate).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

OUTPUT_KEYS = ("generated_text", "generated_token_ids")


@dataclass
class BatchSettings:
    """What every row is generated with. `model`: a directory, Hub repo or .gguf file (None: the default model),
    with `gguf_file` and `revision` as in from_pretrained;
    `method`: a custom_generate directory or Hub repo, run with `trust_remote_code` (or a pinned revision);
    `generation`: generate() keywords (max_new_tokens, do_sample, a plugin's fields, ...); `chat`: wrap each
    prompt in the chat template as a user message."""

    model: str | None = None
    gguf_file: str | None = None
    revision: str | None = None
    backend: str | None = None
    dtype: str = "float32"
    quantize: str | None = None
    method: str | None = None
    trust_remote_code: bool = False
    generation: dict = field(default_factory=dict)
    chat: bool = False
    prompt_key: str = "prompt"


class RowGenerator:
    """The model and tokenizer of `settings`, loaded once; `generator(prompt) -> {"generated_text", "generated_token_ids"}`."""

    def __init__(self, settings: BatchSettings):
        from .models.default import load_model

        self.settings = settings
        self.model, self.tokenizer = load_model(settings.model, dtype=settings.dtype, quantize=settings.quantize,
                                                revision=settings.revision, gguf_file=settings.gguf_file,
                                                backend=settings.backend)

    def __call__(self, prompt: str) -> dict[str, Any]:
        import torch

        from .models.tokenizer import prompt_ids

        tok, settings = self.tokenizer, self.settings
        ids = prompt_ids(tok, prompt, chat=settings.chat)
        method = {"custom_generate": settings.method, "trust_remote_code": settings.trust_remote_code} if settings.method else {}
        out = self.model.generate(ids, tokenizer=tok, **method, **settings.generation)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        new = sequences[0, ids.shape[1]:]
        return {"generated_text": tok.decode(new, skip_special_tokens=True), "generated_token_ids": new.tolist()}


def read_rows(path: Path, prompt_key: str) -> list[dict]:
    """The input rows, each with its "id" (the line number where it has none); a line that is not a JSON
    object with a string under `prompt_key` is a ValueError naming the file and line."""
    rows, seen = [], set()
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error}).") from None
            if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
                raise ValueError(f"{path}:{number}: expected a JSON object with a string under {prompt_key!r} "
                                 f"(the prompt; --prompt-key names another key).")
            row.setdefault("id", number)
            if _key(row["id"]) in seen:
                raise ValueError(f"{path}:{number}: id {row['id']!r} appears twice; ids must be unique.")
            seen.add(_key(row["id"]))
            rows.append(row)
    return rows


def done_ids(path: Path) -> set:
    """The ids of the rows already in the output. A last line cut off mid-write (no newline, not JSON) is
    removed so the row is generated again; anything else in the file is kept as it is."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        try:
            json.loads(data[cut:])
        except ValueError:
            with open(path, "r+b") as out:
                out.truncate(cut)
            data = data[:cut]
        else:
            with open(path, "ab") as out:
                out.write(b"\n")
    done = set()
    for line in data.decode("utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "id" in row and all(k in row for k in OUTPUT_KEYS):
            done.add(_key(row["id"]))
    return done


def _key(row_id) -> str:
    return json.dumps(row_id, sort_keys=True)


def run_batch(input_path: str | os.PathLike, output_path: str | os.PathLike, settings: BatchSettings,
              ray_address: str | None = None, progress: bool = True, concurrency: int = 1) -> tuple[int, int]:
    """Generates for every row of `input_path` not yet in `output_path`, appending each as it is done;
    returns (rows generated now, rows skipped as already done). `ray_address`: "local" or a cluster's address
    to run on Ray (decodekit.integrations.ray), else here."""
    input_path, output_path = Path(input_path), Path(output_path)
    rows = read_rows(input_path, settings.prompt_key)
    done = done_ids(output_path)
    pending = [row for row in rows if _key(row["id"]) not in done]
    if ray_address is not None:
        from .integrations.ray import generate_on_ray

        results: Iterable[dict] = generate_on_ray(pending, settings, ray_address, concurrency=concurrency)
    else:
        results = _here(pending, settings) if pending else iter(())
    if progress:
        from tqdm.auto import tqdm

        results = tqdm(results, total=len(pending), desc="decodekit batch", unit="row")
    written = 0
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "a", encoding="utf-8") as out:
        for row in results:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()  # a row on disk is a row a later run skips
            written += 1
    return written, len(rows) - len(pending)


def _here(rows: list[dict], settings: BatchSettings) -> Iterator[dict]:
    generator = RowGenerator(settings)
    for row in rows:
        yield {**row, **generator(row[settings.prompt_key])}

