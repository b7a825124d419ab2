"""Batch generation over rows of prompts: what `decodekit batch` and the Ray integration run.

A JSON Lines file in, one object per line with a prompt (key "prompt" unless told otherwise) and optionally an
"id"; a JSON Lines file out, each input row with "generated_text" and "generated_token_ids" added. Rows already
in the output (by id; the line number where a row has none) are skipped, so a run that stopped goes on where
it was; a line cut off by a crash is the only thing ever removed from the output. A row's output is what
generate() gives for that prompt alone, whatever decoding method it uses (built-in fields, a hook-only method
or a full-loop custom_generate): rows share continuous batching's steps where the method allows it (its
results equal generate() alone), else each prompt runs on its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

OUTPUT_KEYS = ("generated_text", "generated_token_ids")
CHUNK_ROWS = 32  # rows generated together (continuous batching) before they are written


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
    """The model and tokenizer of `settings`, loaded once; `generator(prompt) -> {"generated_text",
    "generated_token_ids"}`, and `generator.many(prompts)` for several."""

    def __init__(self, settings: BatchSettings):
        from .models.default import load_model

        model, tokenizer = load_model(settings.model, dtype=settings.dtype, quantize=settings.quantize,
                                      revision=settings.revision, gguf_file=settings.gguf_file, backend=settings.backend)
        self._start(settings, model, tokenizer)

    @classmethod
    def around(cls, settings: BatchSettings, model, tokenizer) -> "RowGenerator":
        """A generator over a model and tokenizer already loaded (settings' model fields are not read)."""
        generator = cls.__new__(cls)
        generator._start(settings, model, tokenizer)
        return generator

    def _start(self, settings: BatchSettings, model, tokenizer) -> None:
        self.settings, self.model, self.tokenizer = settings, model, tokenizer
        self.batched: bool | None = None  # whether many() batches; known after its first call
        self._manager = None

    def _arguments(self) -> dict[str, Any]:
        s = self.settings
        method = {"custom_generate": s.method, "trust_remote_code": s.trust_remote_code} if s.method else {}
        return {"tokenizer": self.tokenizer, **method, **s.generation}

    def __call__(self, prompt: str) -> dict[str, Any]:
        import torch

        from .models.tokenizer import prompt_ids

        ids = prompt_ids(self.tokenizer, prompt, chat=self.settings.chat)
        out = self.model.generate(ids, **self._arguments())
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        return self._row(sequences[0, ids.shape[1]:].tolist())

    def _row(self, tokens: list[int]) -> dict[str, Any]:
        return {"generated_text": self.tokenizer.decode(tokens, skip_special_tokens=True), "generated_token_ids": tokens}

    def many(self, prompts: list[str]) -> list[dict[str, Any]]:
        """The rows of `prompts`, in order. They share continuous batching's steps where the settings allow it
        (each result is still what generate() gives for that prompt alone); a method or strategy that owns the
        loop (a full-loop custom_generate, beam search, assisted decoding, ...) runs one generate() per prompt."""
        if self.batched is not False and prompts:
            rows = self._batched(prompts)
            if rows is not None:
                return rows
        return [self(prompt) for prompt in prompts]

    def _batched(self, prompts: list[str]) -> list[dict[str, Any]] | None:
        from .models.tokenizer import prompt_ids

        if not hasattr(self.model, "init_continuous_batching"):
            self.batched = False
            return None
        if self._manager is None:
            self._manager = self.model.init_continuous_batching()
        manager, arguments = self._manager, self._arguments()
        ids = [prompt_ids(self.tokenizer, prompt, chat=self.settings.chat)[0].tolist() for prompt in prompts]
        requests = []
        for prompt in ids:
            try:
                requests.append(manager.add_request(prompt, **arguments))
            except ValueError:
                if self.batched:
                    raise
                self.batched = False  # what continuous batching refuses runs one prompt at a time, errors and all
                return None
            self.batched = True
        manager.run(until_idle=True)
        rows = []
        for prompt, request in zip(prompts, requests):
            out = manager.get_result(request, timeout=0)
            if out.error is not None:
                raise RuntimeError(f"generating for the prompt {prompt[:60]!r} failed: {out.error}")
            rows.append(self._row(list(out.generated_tokens)))
        return rows


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
    for start in range(0, len(rows), CHUNK_ROWS):  # written chunk by chunk: a stop loses at most one chunk
        chunk = rows[start:start + CHUNK_ROWS]
        for row, result in zip(chunk, generator.many([row[settings.prompt_key] for row in chunk])):
            yield {**row, **result}

