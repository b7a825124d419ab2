"""decodekit methods inside vLLM: `DecodekitLogitsProcessor`, a logits processor for vLLM's V1 model runner
(the one vLLM 0.32's CPU build runs) that applies decodekit hook methods per request.

A request chooses with `SamplingParams(extra_args={"decodekit": {"method": NAME, **fields}})`; over HTTP, where
`vllm_xargs` values cannot be objects, with the object's JSON text: `"vllm_xargs": {"decodekit": "{...}"}`. NAME is an installed decodekit plugin (entry-point group `decodekit`) or a
hook-only method the operator allowed when the engine started, never one named by a request:

    DECODEKIT_VLLM_METHODS="./my_method@<content hash>,org/repo@<commit>" vllm serve MODEL \\
        --logits-processors decodekit.integrations.vllm:DecodekitLogitsProcessor

Each entry is a local directory or Hub repo with the revision its code is trusted at (decodekit's trust gate:
the error for an unpinned entry prints the revision to pin). Installing decodekit into vLLM's environment
registers the processor through the entry-point group `vllm.logits_processors`: then do not also name it in
`--logits-processors`, or each method would run twice.

What maps: logits processors as they are (sequence-reading ones get the request's prompt and output ids);
a token selector becomes a processor that keeps only the token it chooses; a stopping criterion that says
done forces EOS. A method that makes the cache, runs its own loop or reads logits another way cannot run in
vLLM and is refused when the request is validated, with the message decodekit gives. Fields are validated
by the method's own validation, so a bad value is a 400 with decodekit's message.

Each request's processors run on its own row. Running requests that share score-only processors as one tensor
of their rows was tried and measured slower on CPU than row by row, at the step and in the engine's throughput
(docs/performance.md), so it is not done.

The V2 model runner (the default where Triton is installed, i.e. vLLM's GPU builds) has a slot-keyed processor
API and refuses entry-point classes without it; `DecodekitLogitsProcessor` serves both runners (a
`SlotProcessor` under V2). The V2 path is tested against its interface with constructed batches only: its
runner needs Triton, which this project's CPU machines lack, so no V2 engine has run it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from ..core.config import GenerationConfig
from ..registry.manager import outside_plugins
from .hooks import OWN_LOOP_HOOKS, Chosen, Engine

logger = logging.getLogger("decodekit")

METHODS_VARIABLE = "DECODEKIT_VLLM_METHODS"
KEY = "decodekit"
VLLM = Engine(
    "vLLM",
    OWN_LOOP_HOOKS,
    "vLLM selects tokens, keeps the cache and runs the loop itself; run this method with decodekit's own generate().",
)
# Built-in plugins a request may name too: llama.cpp's samplers, which vLLM does not have.
BUILT_IN = {"llamacpp_samplers"}

_lock = threading.Lock()
_allowed: dict[str, Any] | None = None


def load_allowed(entries: str | list[str], source: str = METHODS_VARIABLE) -> dict[str, Any]:
    """{name: loaded method} of hook-only methods given as SPEC@REVISION entries (a list, or one comma-separated
    string), each loaded through decodekit's trust gate at the revision the operator pinned; `source` names
    where the entries came from in errors."""
    from ..hub_loader.method import load_pinned

    return load_pinned(entries.split(",") if isinstance(entries, str) else entries, source, "vLLM")


def allowed_methods() -> dict[str, Any]:
    """The methods the operator allowed in $DECODEKIT_VLLM_METHODS, loaded once per process."""
    global _allowed
    with _lock:
        if _allowed is None:
            _allowed = load_allowed(os.environ.get(METHODS_VARIABLE, ""))
        return _allowed


def parse(params, model=None, methods: dict[str, Any] | None = None) -> Chosen | None:
    """The decodekit choice of a request's SamplingParams, validated (ValueError with decodekit's message), or None;
    `methods` are the allowed ones (the engine's, from $DECODEKIT_VLLM_METHODS, unless given)."""
    extra = getattr(params, "extra_args", None) or {}
    spec = extra.get(KEY)
    if spec is None:
        return None
    if isinstance(spec, str):  # over HTTP: vllm_xargs values cannot be objects, so the object comes as JSON text
        try:
            spec = json.loads(spec)
        except ValueError:
            pass
    if not isinstance(spec, dict) or not isinstance(spec.get("method"), str):
        raise ValueError(
            f'extra_args["{KEY}"] must be an object {{"method": NAME, ...fields}} (or its JSON text); got {spec!r}.'
        )
    fields = {k: v for k, v in spec.items() if k != "method"}
    name, plugins = spec["method"], outside_plugins() | BUILT_IN
    methods = allowed_methods() if methods is None else methods
    if name in methods:
        chosen = Chosen({methods[name].plugin_name}, (methods[name].module, methods[name].plugin_name))
    elif name in plugins:
        chosen = Chosen({name})
    else:
        raise ValueError(
            f"decodekit method {name!r} is neither an installed decodekit plugin nor a method allowed when "
            f"the engine started ({METHODS_VARIABLE}); available: {sorted(set(plugins) | set(methods))}."
        )
    return chosen.configure(fields, f"decodekit method {name!r}", model or _StandIn(None, None), VLLM)


class _StandIn:
    """What hooks may read of `context.model` in vLLM: config.vocab_size / eos_token_id, device, generation_config."""

    def __init__(self, vocab_size, eos_token_id, tokenizer_name=None, max_model_len=None):
        self.config = SimpleNamespace(
            vocab_size=vocab_size, eos_token_id=eos_token_id, max_position_embeddings=max_model_len
        )
        self.generation_config = GenerationConfig(eos_token_id=eos_token_id)
        self.device = torch.device("cpu")
        self.tokenizer_name, self._tokenizer = tokenizer_name, None

    def tokenizer(self):
        """The engine's tokenizer (transformers', which vLLM's environment has), loaded when a hook first needs it."""
        if self._tokenizer is None and self.tokenizer_name is not None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name)
        return self._tokenizer


class RequestHooks:
    """One request's processors, selector and stopping criteria, called by vLLM with the request's prompt ids,
    its output ids so far (a live list) and its logits row [V].

    A request fails alone: whatever its hooks raise, when they are made or at any step (SystemExit included),
    is logged once and the request is ended (its row takes EOS; with ignore_eos it stops at max_tokens), since an
    exception out of a logits processor stops vLLM's engine for every request."""

    def __init__(self, request: Chosen, model: _StandIn, prompt_length: int, max_length: int, eos: list[int]):
        self.eos, self.failed = eos, None
        self.name = sorted(request.plugins)[0] if request.plugins else "?"
        try:
            # The tokenizer is for hooks that read text (DRY's breakers).
            hooks = request.prepare(
                model, VLLM, prompt_length=prompt_length, max_length=max_length, tokenizer=model.tokenizer()
            )
            self.processors, self.criteria, self.selector = hooks.processors, hooks.criteria, hooks.selector
        except BaseException as error:  # noqa: BLE001 - see the class's docstring
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        self.failed = error
        logger.error(
            "decodekit method %r failed on a request (%s: %s); the request is ended",
            self.name,
            type(error).__name__,
            error,
        )

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self.failed is None:
            try:
                return self._apply(prompt_ids, output_ids, logits)
            except BaseException as error:  # noqa: BLE001 - see the class's docstring
                self._fail(error)
        return _only(logits, self.eos) if self.eos else logits

    def _apply(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=logits.device)
        scores = logits[None].float()
        if output_ids and self.eos and len(self.criteria) and bool(self.criteria(ids, scores).any()):
            return _only(logits, self.eos)  # a criterion says done: the row takes EOS
        scores = self.processors(ids, scores) if self.processors else scores
        if self.selector is not None:
            return _only(scores[0].to(logits.dtype), [int(self.selector(ids, scores)[0])])
        return scores[0].to(logits.dtype)


def _only(row: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    kept = torch.full_like(row, -float("inf"))
    kept[tokens] = row[tokens].clamp(min=torch.finfo(row.dtype).min)  # finite, so sampling picks among them
    return kept


def _engine_facts(vllm_config) -> tuple[_StandIn, list[int], int]:
    """What hooks may read of the engine's model (a stand-in), its EOS ids and its longest sequence."""
    model_config = vllm_config.model_config
    eos = getattr(getattr(model_config, "hf_config", None), "eos_token_id", None)
    return (
        _StandIn(
            model_config.get_vocab_size(),
            eos,
            getattr(model_config, "tokenizer", None) or getattr(model_config, "model", None),
            model_config.max_model_len,
        ),
        [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        model_config.max_model_len,
    )


def _max_tokens(params, max_model_len: int) -> int:
    return getattr(params, "max_tokens", None) or max_model_len


try:  # vLLM's V2 model runner and its slot-keyed processor interface (vLLM >= 0.32)
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as SlotInterface
except ImportError:
    SlotInterface = None


class SlotProcessor(SlotInterface or object):
    """The same per-request hooks for vLLM's V2 model runner, whose processors keep state per request slot and
    see the whole batch at once (rows reordered every step; under speculative decoding a request has one row per
    draft token). A row's sequence is its request's committed tokens before the row's first position, then the
    tokens fed at the request's rows up to this one; a row still reading its prompt, or the prompt and outputs it
    is refilled with after preemption (chunked prefill), is left alone."""

    def __init__(self, vllm_config, req_states):
        self.states = req_states
        self.model, self.eos, self.max_model_len = _engine_facts(vllm_config)
        self.requests: dict[int, tuple[Chosen, int]] = {}
        self.hooks: dict[int, RequestHooks] = {}
        allowed_methods()

    # validate_params: vLLM calls the entry-point class's (DecodekitLogitsProcessor's), not this one's.

    def add_request(self, req_idx: int, sampling_params) -> bool:
        self.hooks.pop(req_idx, None)  # slots are recycled: nothing of the previous occupant stays
        request = parse(sampling_params, self.model)
        if request is None:
            self.requests.pop(req_idx, None)
            return False
        self.requests[req_idx] = (request, _max_tokens(sampling_params, self.max_model_len))
        return True

    def apply_staged_writes(self) -> None:
        pass

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        if not self.requests:
            return logits
        rows_of: dict[int, list[int]] = {}
        for row, slot in enumerate(ctx.expanded_idx_mapping.tolist()):
            if slot in self.requests:
                rows_of.setdefault(slot, []).append(row)
        if not rows_of:
            return logits
        local, positions, fed = (ctx.expanded_local_pos.tolist(), ctx.pos.tolist(), ctx.input_ids.tolist())
        for slot, rows in rows_of.items():
            rows.sort(key=local.__getitem__)
            start, prompt_length = positions[rows[0]], int(self.states.prompt_len.np[slot])
            if start + 1 < int(self.states.prefill_len.np[slot]):
                continue  # a chunk of the (re)filled tokens: nothing is sampled from it
            hooks = self.hooks.get(slot)
            if hooks is None:
                request, max_tokens = self.requests[slot]
                hooks = self.hooks[slot] = RequestHooks(
                    request, self.model, prompt_length, prompt_length + max_tokens, self.eos
                )
            sequence = self.states.all_token_ids.gpu[slot, :start].tolist()
            for row in rows:
                sequence.append(fed[row])
                logits[row] = hooks(sequence[:prompt_length], sequence[prompt_length:], logits[row])
        return logits


class DecodekitLogitsProcessor(AdapterLogitsProcessor):
    """vLLM logits processor running decodekit hook methods per request (see the module's docstring).

    vLLM loads every class of the entry-point group for whichever model runner it starts, and the V2 runner
    refuses classes without its interface: so this one class serves both. Constructed with the V1 runner's
    arguments (vllm_config, device, is_pin_memory) it is the V1 processor below; with the V2 runner's
    (vllm_config, req_states) it gives a SlotProcessor."""

    def __new__(cls, vllm_config, *args, **kwargs):
        if len(args) == 1 and hasattr(args[0], "all_token_ids"):
            return SlotProcessor(vllm_config, args[0])
        return super().__new__(cls)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        super().__init__(vllm_config, device, is_pin_memory)
        self.model, self.eos, self.max_model_len = _engine_facts(vllm_config)
        allowed_methods()  # the operator's methods load (and fail) when the engine starts, not at a request

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        parse(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # a method may change which token is most likely

    def new_req_logits_processor(self, params):
        request = parse(params, self.model)
        if request is None:
            return None
        max_tokens = _max_tokens(params, self.max_model_len)
        hooks_for_prompt = {}

        def run(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            hooks = hooks_for_prompt.get("hooks")
            if hooks is None:  # built at the first step, when the prompt's length is known
                hooks = hooks_for_prompt["hooks"] = RequestHooks(
                    request, self.model, len(prompt_ids), len(prompt_ids) + max_tokens, self.eos
                )
            return hooks(prompt_ids, output_ids, logits)

        return run


if SlotInterface is not None:
    SlotInterface.register(DecodekitLogitsProcessor)
