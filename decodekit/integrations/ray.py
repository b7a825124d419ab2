"""Batch generation on Ray with any decodekit method.

`BatchGenerator` is a callable class for `ray.data.Dataset.map_batches` with an actor pool: each actor loads
the model once and generates for every row of its batches (a prompt column in, "generated_text" and
"generated_token_ids" out), with built-in fields, a hook-only method or a full-loop custom_generate:

    import ray
    from decodekit.integrations.ray import BatchGenerator

    ds = ray.data.from_items([{"prompt": "The capital of France is"}, ...])
    out = ds.map_batches(BatchGenerator, fn_constructor_kwargs={"generation": {"max_new_tokens": 32}},
                         batch_size=8, concurrency=2)

Ray is not a dependency of decodekit (`pip install 'ray[data]'`; `make test-ray`); this module imports it
only when a function needs it. Not yet built: the helper that attaches decodekit's processors to ray.data.llm's
vLLM processor, which needs the vLLM adapter (issue 23).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Iterator

from ..batch import OUTPUT_KEYS, BatchSettings, RowGenerator

INSTALL = "pip install 'ray[data]'"
ROW = "_decodekit_row"


def require_ray():
    try:
        import ray
        import ray.data  # noqa: F401  (the part this module uses)
    except ImportError:
        raise ImportError(f"running on Ray needs ray with its data library: {INSTALL}") from None
    return ray


class BatchGenerator:
    """For `map_batches`: the keyword arguments are BatchSettings' fields (model, backend, dtype, quantize,
    method, trust_remote_code, generation, chat, prompt_key)."""

    def __init__(self, **settings):
        self.settings = BatchSettings(**settings)
        self.rows = RowGenerator(self.settings)

    def __call__(self, batch: dict) -> dict:
        results = [self.rows(str(prompt)) for prompt in batch[self.settings.prompt_key]]
        return {**{k: list(v) for k, v in batch.items()},
                "generated_text": [r["generated_text"] for r in results],
                "generated_token_ids": [r["generated_token_ids"] for r in results]}


def generate_on_ray(rows: list[dict], settings: BatchSettings, address: str = "local", concurrency: int = 1,
                    batch_size: int = 8) -> Iterator[dict]:
    """The rows with their generations, computed by `concurrency` actors on the Ray cluster at `address`
    ("local" starts one here, or joins the one already started)."""
    if not rows:
        return
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, include_dashboard=False, log_to_driver=False)
    # Each row travels as its JSON text beside its prompt: rows whose fields differ in kind (an id that is a
    # number in one row and a string in another) would not fit one Arrow schema.
    key = settings.prompt_key
    dataset = ray.data.from_items([{key: row[key], ROW: json.dumps(row)} for row in rows])
    out = dataset.map_batches(BatchGenerator, fn_constructor_kwargs=asdict(settings), batch_size=batch_size,
                              concurrency=concurrency, batch_format="default")
    for result in out.iter_rows():
        yield {**json.loads(result[ROW]), **{k: _plain(result[k]) for k in OUTPUT_KEYS}}


def _plain(value):
    """A value from Ray's batches as plain JSON-able Python (numpy arrays and scalars become lists and numbers)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
