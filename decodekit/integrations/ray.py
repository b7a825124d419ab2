"""Batch generation on Ray with any decodekit method.

`BatchGenerator` is a callable class for `ray.data.Dataset.map_batches` with an actor pool: each actor loads
the model once and generates for every row of its batches (a prompt column in, "generated_text" and
"generated_token_ids" out), with built-in fields, a hook-only method or a full-loop custom_generate:

    import ray
    from decodekit.integrations.ray import BatchGenerator

    ds = ray.data.from_items([{"prompt": "The capital of France is"}, ...])
    out = ds.map_batches(BatchGenerator, fn_constructor_kwargs={"generation": {"max_new_tokens": 32}},
                         batch_size=8, concurrency=2)

Where the model runs on vLLM instead, `vllm_processor` builds a ray.data.llm processor whose engines apply a
decodekit hook-only method to every row through decodekit's vLLM logits processor
(decodekit/integrations/vllm.py):

    from decodekit.integrations.ray import vllm_processor

    processor = vllm_processor("./model", method="./my_method", fields={"banned_token": 42},
                               allowed=["./my_method@<content hash>"], sampling={"max_tokens": 32})
    out = processor(ds)  # the rows with generated_text and generated_token_ids

Ray is not a dependency of decodekit (`pip install 'ray[data]'`; `make test-ray`); this module imports it
only when a function needs it. vllm_processor needs ray.data.llm and vLLM in one environment
(`make test-vllm` builds one).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, Iterator, Sequence

from ..batch import ERROR_KEY, OUTPUT_KEYS, BatchSettings, RowGenerator
from ..core.config import is_int

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
        results = self.rows.many([str(prompt) for prompt in batch[self.settings.prompt_key]])
        # Every row has every column (one Arrow schema): a failed row's generation is empty, its error set.
        return {**{k: list(v) for k, v in batch.items()},
                "generated_text": [r.get("generated_text", "") for r in results],
                "generated_token_ids": [r.get("generated_token_ids", []) for r in results],
                ERROR_KEY: [r.get(ERROR_KEY, "") for r in results]}


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
        row = json.loads(result[ROW])
        if result.get(ERROR_KEY):
            yield {**row, ERROR_KEY: result[ERROR_KEY]}
        else:
            yield {**row, **{k: _plain(result[k]) for k in OUTPUT_KEYS}}


def _plain(value):
    """A value from Ray's batches as plain JSON-able Python (numpy arrays and scalars become lists and numbers)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


DEVICES = ("cpu", "cuda")
INPUT = "decodekit_input."
LIGHT_CPUS = 0.25


def vllm_processor(model: str, method: str | None = None, *, fields: dict[str, Any] | None = None,
                   allowed: Sequence[str] = (), sampling: dict[str, Any] | None = None, prompt_key: str = "prompt",
                   chat: bool = False, device: str = "cpu", cpus: int = 1, concurrency: int = 1,
                   batch_size: int = 16, engine_kwargs: dict[str, Any] | None = None, **config):
    """A ray.data.llm processor generating for each row's `prompt_key` on vLLM engines (`concurrency` of them,
    `model` a transformers directory or Hub repo), with the decodekit hook-only `method` (an installed plugin
    or one of `allowed`, entries SPEC@REVISION: the trust the operator gives, loaded through decodekit's
    trust gate) and its `fields` applied to every row. The choice is validated here, with decodekit's
    messages, before any engine starts. `sampling` is vLLM's SamplingParams fields (default greedy, 64 tokens);
    `chat` applies the model's chat template to the prompt as a user message; `device` "cpu" gives each engine
    `cpus` CPUs, "cuda" one GPU. The output rows are the input rows with "generated_text" and
    "generated_token_ids". `engine_kwargs` go to vLLM, other keywords to vLLMEngineProcessorConfig."""
    from types import SimpleNamespace

    from .vllm import KEY, METHODS_VARIABLE, load_allowed, parse

    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}; got {device!r}.")
    if not is_int(cpus) or cpus < 1:
        raise ValueError(f"cpus must be a positive integer; got {cpus!r}.")
    if isinstance(allowed, str):
        raise TypeError(f"allowed must be a list of SPEC@REVISION entries, not one string; got {allowed!r}.")
    if fields and method is None:
        raise ValueError("fields are a method's fields: give the method they belong to as method=.")
    choice = None if method is None else json.dumps({"method": method, **(fields or {})})
    if choice is not None:
        parse(SimpleNamespace(extra_args={KEY: choice}), methods=load_allowed(list(allowed), source="allowed"))
    require_ray()
    try:
        from ray.data.llm import build_processor, vLLMEngineProcessorConfig
    except ImportError:
        raise ImportError("vllm_processor needs ray.data.llm and vLLM in this environment: "
                          "pip install 'ray[data]' and vLLM (`make test-vllm` builds such an environment)") from None

    engine_kwargs = dict(engine_kwargs or {})
    if not _processor_installed():  # installed decodekit registers it already; naming it twice would run methods twice
        engine_kwargs.setdefault("logits_processors", ["decodekit.integrations.vllm:DecodekitLogitsProcessor"])
    runtime_env = dict(config.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), METHODS_VARIABLE: ",".join(allowed)}
    config.setdefault("log_engine_metrics", False)  # True needs ray[serve] (Ray's metrics export), not ray[data]
    if device == "cpu":
        config.setdefault("placement_group_config", {"bundles": [{"CPU": cpus}]})
    # The engine tokenizes and detokenizes itself; ray.data.llm's separate stages would each hold a CPU actor. The
    # chat template's stage and the row functions are light: a quarter CPU each, so a 2-CPU cluster fits them
    # beside an engine (with a whole CPU each they would wait for one another forever).
    processor_config = vLLMEngineProcessorConfig(
        model_source=model, engine_kwargs=engine_kwargs, concurrency=concurrency, batch_size=batch_size,
        runtime_env=runtime_env, chat_template_stage={"enabled": chat, "num_cpus": LIGHT_CPUS},
        tokenize_stage=False, detokenize_stage=False, **config)
    params = {"temperature": 0.0, "max_tokens": 64, **(sampling or {})}
    if choice is not None:
        params["extra_args"] = {**(params.get("extra_args") or {}), KEY: choice}  # JSON text: one Arrow schema

    # The input row's columns travel under a prefix, so the stages' own columns (prompt, messages, metrics...)
    # neither clash with them nor reach the output.
    def preprocess(row: dict) -> dict:
        prompt = str(row[prompt_key])
        text = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        return {**{INPUT + k: v for k, v in row.items()}, **text, "sampling_params": params}

    def postprocess(row: dict) -> dict:
        return {**{k[len(INPUT):]: v for k, v in row.items() if k.startswith(INPUT)},
                "generated_text": row["generated_text"], "generated_token_ids": _plain(row["generated_tokens"])}

    light = {"num_cpus": LIGHT_CPUS}
    return build_processor(processor_config, preprocess=preprocess, postprocess=postprocess,
                           preprocess_map_kwargs=light, postprocess_map_kwargs=light)


def _processor_installed() -> bool:
    from importlib.metadata import entry_points

    return any(e.value.startswith("decodekit.") for e in entry_points(group="vllm.logits_processors"))
