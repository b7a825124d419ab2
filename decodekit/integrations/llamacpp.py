"""decodekit methods inside llama.cpp, through llama-cpp-python's high-level API: `hooks(llm, method=...)` gives a
`logits_processor` and `stopping_criteria` for `Llama.__call__` / `create_completion`, so a user with a GGUF file
in llama.cpp applies a decodekit hook-only method (or registered plugins) without changing engine:

    from llama_cpp import Llama
    from decodekit.integrations.llamacpp import hooks

    llm = Llama(model_path="model.gguf")
    h = hooks(llm, method="./my_method", trust_remote_code=True, banned_token=42)
    llm("The capital of France is", max_tokens=16, logits_processor=h.logits_processor,
        stopping_criteria=h.stopping_criteria)

What maps, as in the vLLM adapter: the method's logits processors run on llama.cpp's logits (the sequence so far
is the prompt and the tokens generated); a token selector becomes a processor that leaves only the token it
chooses; a stopping criterion ends generation. A method that makes the cache, runs its own loop or reads logits
another way cannot run inside llama.cpp and is refused. The method loads through decodekit's trust gate, as
everywhere. One `hooks` object serves one generation at a time; it starts over when a new prompt comes.
Imports llama_cpp only here (`make test-llamacpp` builds it from source).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ..core.config import GenerationConfig
from .hooks import OWN_LOOP_HOOKS, Chosen, Engine, choose

LLAMACPP = Engine(
    "llama.cpp",
    OWN_LOOP_HOOKS,
    "llama.cpp keeps the cache and runs the loop itself; run this method with decodekit's own generate().",
)


class LlamaCppHooks:
    """`logits_processor` and `stopping_criteria` (llama-cpp-python's lists) running decodekit hooks."""

    def __init__(self, llm, chosen: Chosen, tokenizer=None):
        import llama_cpp

        self.chosen, self.tokenizer = chosen, tokenizer
        eos = llm.token_eos()
        self.eos = [] if eos is None or eos < 0 else [int(eos)]
        self.model = SimpleNamespace(
            config=SimpleNamespace(
                vocab_size=llm.n_vocab(),
                eos_token_id=self.eos[0] if self.eos else None,
                max_position_embeddings=llm.n_ctx(),
            ),
            generation_config=GenerationConfig(eos_token_id=self.eos or None),
            device=torch.device("cpu"),
        )
        self.prompt_length = None
        self.logits_processor = llama_cpp.LogitsProcessorList([self._process])
        self.stopping_criteria = llama_cpp.StoppingCriteriaList([self._stop])

    def _start(self, prompt_length: int) -> None:
        self.prompt_length = prompt_length
        hooks = self.chosen.prepare(
            self.model,
            LLAMACPP,
            prompt_length=prompt_length,
            max_length=self.model.config.max_position_embeddings,
            tokenizer=self.tokenizer,
        )
        self.processors, self.criteria, self.selector = hooks.processors, hooks.criteria, hooks.selector

    def _ids(self, input_ids) -> torch.Tensor:
        ids = torch.as_tensor(list(input_ids), dtype=torch.long)[None]
        if self.prompt_length is None or ids.shape[1] <= self.prompt_length:  # a new generation
            self._start(ids.shape[1])
        return ids

    def _process(self, input_ids, scores):
        import numpy as np

        ids = self._ids(input_ids)
        row = torch.from_numpy(np.ascontiguousarray(scores, dtype=np.float32))[None]
        out = self.processors(ids, row) if self.processors else row
        if self.selector is not None:
            chosen = int(self.selector(ids, out)[0])
            kept = torch.full_like(out, -float("inf"))
            kept[0, chosen] = 0.0
            out = kept
        return out[0].numpy().astype(scores.dtype, copy=False)

    def _stop(self, input_ids, logits) -> bool:
        ids = self._ids(input_ids)
        if ids.shape[1] == self.prompt_length or not len(self.criteria):
            return False
        scores = torch.from_numpy(logits.astype("float32"))[None] if logits is not None else torch.zeros(1, 1)
        return bool(self.criteria(ids, scores).any())


def hooks(
    llm,
    *,
    method=None,
    plugins: list[str] | None = None,
    trust_remote_code=None,
    revision: str | None = None,
    tokenizer=None,
    **fields: Any,
) -> LlamaCppHooks:
    """decodekit hooks for a llama_cpp.Llama: one hook-only `method` (a local directory or Hub repo, through the trust
    gate with `trust_remote_code` / `revision`), else `plugins` (names of registered plugins), else every registered
    outside plugin; `fields` are the config fields they read (a method's own keywords). `tokenizer`: a decodekit or
    transformers tokenizer, for hooks that read text (stop strings). ValueError, with decodekit's message, for an
    unknown field or a plugin llama.cpp cannot take."""
    chosen = choose(
        method,
        plugins,
        trust_remote_code,
        revision,
        "llama.cpp runs hook-only methods (logits "
        "processors, a selector, stopping criteria): run it with decodekit's generate().",
    )
    out = LlamaCppHooks(llm, chosen, tokenizer)
    chosen.configure(fields, "hooks()", out.model, LLAMACPP)
    return out
