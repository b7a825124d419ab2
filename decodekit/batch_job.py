"""Batch generation over rows of prompts: what `decodekit batch` and the Ray integration run.

A JSON Lines file in (UTF-8, a byte-order mark allowed), one object per line with a prompt (key "prompt" unless
told otherwise) and optionally an "id"; a JSON Lines file out, each input row with "generated_text" and
"generated_token_ids" added, written the moment it is done. A row that cannot be generated (an empty prompt, text
that is not valid Unicode, a method failing on it) fails alone: its line gets "error" instead, naming what went
wrong, and the others go on. Rows already in the output (by id; the line number where a row has none), generated
or failed, are skipped, so a run that stopped goes on where it was; a line cut off by a crash is the only thing
ever removed from the output, and a line that is not JSON (or not UTF-8) is kept as it is and not counted. One run
at a time writes an output file: a second refuses while the first holds its lock.

A row's output is what generate() gives for that prompt alone, whatever decoding method it uses (built-in fields,
a hook-only method or a full-loop custom_generate): rows share continuous batching's steps where the method allows
it (its results equal generate() alone), else each prompt runs on its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

OUTPUT_KEYS = ("generated_text", "generated_token_ids")
ERROR_KEY = "error"
CHUNK_ROWS = 32  # rows added to continuous batching together (each is written when it is done)


class OutputBusy(OSError):
    """Another run holds the output file's lock."""


@dataclass
class BatchSettings:
    """What every row is generated with. `model`: a directory, Hub repo or .gguf file (None: the default model),
    with `gguf_file`, `revision`, `backend`, `dtype`, `quantize` and `device` as in from_pretrained;
    `method`: a custom_generate directory or Hub repo, run with `trust_remote_code` (or a pinned revision);
    `generation`: generate() keywords (max_new_tokens, do_sample, a plugin's fields, ...); `chat`: wrap each
    prompt in the chat template as a user message."""

    model: str | None = None
    gguf_file: str | None = None
    revision: str | None = None
    backend: str | None = None
    dtype: str | None = None  # None: as the files hold them (a GGUF file's blocks kept)
    quantize: str | None = None
    device: str = "cpu"
    method: str | None = None
    trust_remote_code: bool = False
    generation: dict = field(default_factory=dict)
    chat: bool = False
    prompt_key: str = "prompt"


class RowGenerator:
    """The model and tokenizer of `settings`, loaded once; `generator(prompt) -> {"generated_text",
    "generated_token_ids"}`, and `generator.many(prompts)` for several."""

    def __init__(self, settings: BatchSettings):
        from .loading.default import load_model

        model, tokenizer = load_model(
            settings.model,
            dtype=settings.dtype,
            quantize=settings.quantize,
            revision=settings.revision,
            gguf_file=settings.gguf_file,
            backend=settings.backend,
            device=settings.device,
        )
        self._start(settings, model, tokenizer)

    @classmethod
    def around(cls, settings: BatchSettings, model, tokenizer) -> "RowGenerator":
        """A generator over a model and tokenizer already loaded (settings' model fields are not read)."""
        generator = cls.__new__(cls)
        generator._start(settings, model, tokenizer)
        return generator

    def _start(self, settings: BatchSettings, model, tokenizer) -> None:
        self.settings, self.model, self.tokenizer = settings, model, tokenizer
        self.batched: bool | None = None  # whether many() batches; decided at its first call
        self._manager = None

    def _arguments(self) -> dict[str, Any]:
        s = self.settings
        method = {"custom_generate": s.method, "trust_remote_code": s.trust_remote_code} if s.method else {}
        return {"tokenizer": self.tokenizer, **method, **s.generation}

    def _ids(self, prompt: str):
        from .loading.tokenizer import prompt_ids

        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("the prompt is empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"the prompt is not valid Unicode (a lone surrogate at character {error.start})") from None
        return prompt_ids(self.tokenizer, prompt, chat=self.settings.chat)

    def __call__(self, prompt: str) -> dict[str, Any]:
        """The row of one prompt; raises what generate() raises."""
        import torch

        ids = self._ids(prompt).to(self.model.device)
        out = self.model.generate(ids, **self._arguments())
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        return self._row(sequences[0, ids.shape[1] :].tolist())

    def _row(self, tokens: list[int]) -> dict[str, Any]:
        return {
            "generated_text": self.tokenizer.decode(tokens, skip_special_tokens=True),
            "generated_token_ids": tokens,
        }

    def many(self, prompts: list[str], on_row=None) -> list[dict[str, Any]]:
        """The rows of `prompts`, in order: {"generated_text", "generated_token_ids"}, or {"error": why} for a prompt
        that failed (alone: the others go on). `on_row(index, row)` is called as each one is done. They share
        continuous batching's steps where the settings allow it (each result is still what generate() gives for
        that prompt alone); a method or strategy that owns the loop (a full-loop custom_generate, beam search,
        assisted decoding, ...) runs one generate() per prompt."""
        rows: list[dict[str, Any] | None] = [None] * len(prompts)

        def done(index: int, row: dict[str, Any]) -> None:
            rows[index] = row
            if on_row is not None:
                on_row(index, row)

        if prompts and self._can_batch():
            self._batched(prompts, done)
        else:
            for index, prompt in enumerate(prompts):
                done(index, self._alone(prompt))
        return rows

    def _alone(self, prompt: str) -> dict[str, Any]:
        try:
            return self(prompt)
        except Exception as error:  # noqa: BLE001 - a row's failure is that row's: recorded, and the run goes on
            return {ERROR_KEY: f"{type(error).__name__}: {error}"}

    def _can_batch(self) -> bool:
        """Whether the settings run under continuous batching, decided once with a one-token probe: never by a
        row, so a bad first row cannot send every row down the slow path."""
        if self.batched is None:
            self.batched = False
            if hasattr(self.model, "init_continuous_batching"):
                self._manager = self.model.init_continuous_batching()
                probe = next(
                    (t for t in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id) if t is not None), 0
                )
                try:
                    request = self._manager.add_request([probe], **self._arguments())
                except ValueError:  # what continuous batching refuses runs one prompt at a time
                    return False
                self._manager.cancel_request(request, keep_result=False)
                self._manager.run(until_idle=True)
                self.batched = True
        return self.batched

    def _batched(self, prompts: list[str], done) -> None:
        from .batching import RequestStatus

        manager, arguments = self._manager, self._arguments()
        index_of = {}
        for index, prompt in enumerate(prompts):
            try:
                request = manager.add_request(self._ids(prompt)[0].tolist(), **arguments)
            except ValueError as error:
                done(index, {ERROR_KEY: f"ValueError: {error}"})
                continue
            index_of[request] = index

        def ended(output) -> None:
            index = index_of.pop(output.request_id, None)
            if index is None:
                return
            manager.get_result(output.request_id, timeout=0)  # collected here: nothing piles up in the manager
            if output.status == RequestStatus.CANCELLED:  # Ctrl-C: not done, so not written; a resumed run makes it
                return
            if output.error is not None:
                done(index, {ERROR_KEY: output.error})
            else:
                done(index, self._row(list(output.generated_tokens)))

        manager.on_end = ended
        try:
            manager.run(until_idle=True)
        finally:
            manager.on_end = None


def _json_line(line: bytes, where: str):
    """A line's JSON value; ValueError naming `where` (file:line) for bytes that are not UTF-8 or text that is not
    JSON (nested too deeply included)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{where}: not UTF-8 (byte {error.start + 1} of the line is 0x{line[error.start]:02x})."
        ) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{where}: not JSON (nested too deeply to read).") from None
    except ValueError as error:
        raise ValueError(f"{where}: not JSON ({error}).") from None


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark, as some editors write
        data = data[3:]
    for number, line in enumerate(data.split(b"\n"), 1):
        yield number, line.rstrip(b"\r")


def read_rows(path: Path, prompt_key: str) -> list[dict]:
    """The input rows, each with its "id" (the line number where it has none); a line that is not a JSON
    object with a string under `prompt_key` is a ValueError naming the file and line."""
    rows, seen = [], set()
    for number, line in _lines(Path(path).read_bytes()):
        if not line.strip():
            continue
        row = _json_line(line, f"{path}:{number}")
        if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
            raise ValueError(
                f"{path}:{number}: expected a JSON object with a string under {prompt_key!r} "
                f"(the prompt; --prompt-key names another key)."
            )
        written = sorted(k for k in (*OUTPUT_KEYS, ERROR_KEY) if k in row)
        if written:  # the output would overwrite them, and an "error" column would read as a failed row on resume
            raise ValueError(
                f"{path}:{number}: the row has {written}, which the output writes to each row; rename "
                f"that column in the input."
            )
        row.setdefault("id", number)
        if _key(row["id"]) in seen:
            raise ValueError(f"{path}:{number}: id {row['id']!r} appears twice; ids must be unique.")
        seen.add(_key(row["id"]))
        rows.append(row)
    return rows


def done_ids(path: Path) -> set:
    """The ids of the rows already in the output, generated or failed. A last line cut off mid-write (no newline,
    not JSON) is removed so the row is generated again; anything else in the file, a line that is not UTF-8 or not
    JSON included, is kept as it is and not counted."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        try:
            _json_line(data[cut:], "")
        except ValueError:
            with open(path, "r+b") as out:
                out.truncate(cut)
            data = data[:cut]
        else:
            with open(path, "ab") as out:
                out.write(b"\n")
    done = set()
    for _, line in _lines(data):
        try:
            row = _json_line(line, "")
        except ValueError:
            continue
        if isinstance(row, dict) and "id" in row and (all(k in row for k in OUTPUT_KEYS) or ERROR_KEY in row):
            done.add(_key(row["id"]))
    return done


def _key(row_id) -> str:
    return json.dumps(row_id, sort_keys=True)


@dataclass
class BatchCounts:
    written: int = 0  # rows generated now
    skipped: int = 0  # rows already in the output
    failed: list = field(default_factory=list)  # ids of the rows that failed now (their lines carry "error")

    def __iter__(self):  # (written, skipped), as run_batch returned before it counted failures
        return iter((self.written, self.skipped))

    def __eq__(self, other):
        return tuple(self) == tuple(other) if isinstance(other, tuple) else NotImplemented


def run_batch(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    settings: BatchSettings,
    progress: bool = True,
    runner: Callable[[list[dict], BatchSettings], Iterable[dict]] | None = None,
) -> BatchCounts:
    """Generates for every row of `input_path` not yet in `output_path`, appending each the moment it is done;
    returns the counts (written, skipped, failed ids). `runner(rows, settings)` yields the rows with their results
    in any order (decodekit.integrations.ray.on_ray(address) runs them on Ray); None runs them here, in this
    process. OutputBusy if another run is writing `output_path`."""
    input_path, output_path = Path(input_path), Path(output_path)
    if output_path.exists() and input_path.exists() and os.path.samefile(input_path, output_path):
        raise ValueError(
            f"the output {output_path} is the input file: rows are appended to the output as they are "
            "done, which would change the input; give another output path."
        )
    rows = read_rows(input_path, settings.prompt_key)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    counts = BatchCounts()
    with open(output_path, "a", encoding="utf-8") as out:
        _lock(out, output_path)  # before the output is read: what is done is what no other run is adding to
        done = done_ids(output_path)
        pending = [row for row in rows if _key(row["id"]) not in done]
        counts.skipped = len(rows) - len(pending)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            # Until the first row is done (the model loads, the first step compiles), the bar says so.
            bar = tqdm(total=len(pending), desc="decodekit batch (loading the model)", unit="row")

        def write(row: dict) -> None:
            text = json.dumps(row, ensure_ascii=False)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate the input held: escaped, as it came in
                text = json.dumps(row)
            out.write(text + "\n")
            out.flush()  # a row on disk is a row a later run skips
            if ERROR_KEY in row:
                counts.failed.append(row["id"])
            else:
                counts.written += 1
            if bar is not None:
                if bar.n == 0:
                    bar.set_description("decodekit batch", refresh=False)
                bar.update(1)

        try:
            if runner is not None:
                for row in runner(pending, settings) if pending else ():
                    write(row)
            elif pending:
                _here(pending, settings, write)
        finally:
            if bar is not None:
                bar.close()
    return counts


def _lock(out, path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not on this platform: runs are not kept apart
        return
    try:
        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OutputBusy(
            f"another decodekit batch is writing {path}; wait for it to end (or give this run another output file)."
        ) from None


def _here(rows: list[dict], settings: BatchSettings, write) -> None:
    generator = RowGenerator(settings)
    key = settings.prompt_key
    for start in range(0, len(rows), CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]
        generator.many([row[key] for row in chunk], on_row=lambda index, result: write({**chunk[index], **result}))
