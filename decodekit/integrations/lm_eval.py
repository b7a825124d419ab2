"""decodekit as an lm-evaluation-harness model (`decodekit[eval]`): `lm_eval --model decodekit --model_args
pretrained=PATH,method=ORG/REPO,...`, or DecodekitLM(model, tokenizer) handed to lm_eval.simple_evaluate.

The loglikelihoods are computed as lm-eval's own `hf` model computes them (its oracle, in tests/test_lm_eval.py):
context and continuation encoded whole and the context alone (trailing spaces of the context moved to the
continuation), no special tokens added, an empty context given the tokenizer's BOS (else the end-of-text token); each request's continuation
scored from one forward over (context + continuation)[:-1], several requests a forward (padded on the right: a causal
model's positions never see the padding after them). generate_until runs the method asked for (a Hub, local or
callable method, a built-in strategy, with its arguments and the trust gate as everywhere else) on each request's
context with the harness's stop strings and token budget, requests of the same settings together through continuous
batching where the method allows (no method or a hook-only one), one generate() each for a method that owns its loop.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "decodekit's lm-evaluation-harness model needs lm-eval: pip install 'decodekit[eval]' (make test-eval builds "
        "an environment with it)."
    ) from error

BATCH_TOKENS = 4096  # tokens of one scoring forward (requests x the longest's length)


def _parse_bool(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("decodekit")
class DecodekitLM(LM):
    """lm-eval's model interface over a decodekit model (native or transformers-wrapped)."""

    def __init__(
        self,
        pretrained: str | None = None,
        model=None,
        tokenizer=None,
        method: Any = None,
        method_args: dict | None = None,
        trust_remote_code: Any = False,
        compile: bool = False,
        dtype: str | None = None,
        max_length: int | None = None,
        batch_size: int | str = 8,
        **_ignored,
    ):
        super().__init__()
        if model is None:
            if pretrained is None:
                raise ValueError(
                    "DecodekitLM needs pretrained= (a path, Hub id or .gguf file) or model= (a decodekit model)."
                )
            from ..loading import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=dtype)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(pretrained)
        if tokenizer is None:
            raise ValueError("DecodekitLM(model=...) needs tokenizer= as well.")
        self.model, self.tokenizer = model, tokenizer
        self.method, self.method_args = method, dict(method_args or {})
        self.trust_remote_code, self.compile = trust_remote_code, _parse_bool(compile)
        self.batch = int(batch_size) if str(batch_size).isdigit() else 8
        context = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_length = int(max_length or context)
        eos = model.generation_config.eos_token_ids
        self.eot_token_id = eos[0] if eos else 0
        # What an empty context is given, as lm-eval's hf model: the tokenizer's BOS where it has one, else EOT.
        bos = getattr(tokenizer, "bos_token_id", None)
        self.prefix_token_id = bos if bos is not None else self.eot_token_id
        self.new_tokens = self.generations = 0  # what generate_until generated: tokens and requests
        self._batches: bool | None = None  # whether the method lets requests share a batch (_batchable)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DecodekitLM:
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        args.update({k: v for k, v in (additional_config or {}).items() if v is not None})
        return cls(**args)

    # --- encoding, as lm-eval's hf model does ----------------------------------------------------------------

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        context_ids = self.tok_encode(context)
        return context_ids, whole[len(context_ids) :]

    # --- scoring ------------------------------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args
            context_ids, continuation_ids = (
                ([self.prefix_token_id], self.tok_encode(continuation))
                if context == ""
                else self.encode_pair(context, continuation)
            )
            pairs.append((context_ids, continuation_ids))
        return self.score(pairs, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's whole loglikelihood: windows of max_length tokens, each token scored once (the first
        given the end-of-text token), summed."""
        out = []
        for request in requests:
            (text,) = request.args
            ids = self.tok_encode(text)
            pairs, start = [], 0
            while start < len(ids):
                end = min(len(ids), start + self.max_length)
                context = ids[max(0, end - self.max_length - 1) : start] or [self.prefix_token_id]
                pairs.append((context, ids[start:end]))
                start = end
            out.append(sum(value for value, _ in self.score(pairs)))
        return out

    def score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether each of its tokens is its position's argmax) of each
        (context ids, continuation ids), the longest first in batches of up to `batch` requests and BATCH_TOKENS;
        a progress bar over the requests unless `disable_tqdm`."""
        from tqdm import tqdm

        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        bar = tqdm(total=len(pairs), desc="decodekit: scoring requests", disable=disable_tqdm)
        at = 0
        while at < len(order):
            width = min(self.max_length, len(pairs[order[at]][0]) + len(pairs[order[at]][1]) - 1)
            size = max(1, min(self.batch, BATCH_TOKENS // max(1, width)))
            chunk = order[at : at + size]
            for index, result in zip(chunk, self._score_batch([pairs[i] for i in chunk])):
                results[index] = result
            at += size
            bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    def _score_batch(self, pairs) -> list[tuple[float, bool]]:
        rows = [(context + continuation)[-(self.max_length + 1) :][:-1] for context, continuation in pairs]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=self.model.device)
        with torch.inference_mode():
            logits = self.model(ids, use_cache=False).logits.float()
        out = []
        for row, (_, continuation), length in zip(logits, pairs, (len(r) for r in rows)):
            n = len(continuation)
            logp = torch.log_softmax(row[length - n : length], dim=-1)
            target = torch.tensor(continuation, device=logp.device)
            value = float(logp.gather(1, target[:, None]).sum())
            out.append((value, bool((logp.argmax(-1) == target).all())))
        return out

    # --- generation ---------------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation up to its stop strings: requests that share their generation settings run
        together through continuous batching (generate_batch) where the method lets them (no method, or a hook-only
        one: the tokens each gets alone), else one generate() each (a method that owns its whole loop)."""
        asks = [self._generation(request) for request in requests]
        out: list[str | None] = [None] * len(asks)
        groups: dict[tuple, list[int]] = {}
        for i, (ids, kwargs, until) in enumerate(asks):
            groups.setdefault((tuple(until), repr(sorted(kwargs.items(), key=lambda kv: kv[0]))), []).append(i)
        for members in groups.values():
            kwargs, until = asks[members[0]][1], asks[members[0]][2]
            prompts = [asks[i][0] for i in members]
            for i, new in zip(members, self._generated(prompts, kwargs, not disable_tqdm)):
                self.new_tokens += len(new)
                self.generations += 1
                text = self.tokenizer.decode(new, skip_special_tokens=True)
                cuts = [text.find(stop) for stop in until if stop and stop in text]
                out[i] = text[: min(cuts)] if cuts else text
        return out  # type: ignore[return-value]

    def _generation(self, request) -> tuple[list[int], dict, list[str]]:
        """(prompt ids, generate()'s keyword arguments, stop strings) of one generate_until request."""
        context, options = request.args
        options = dict(options or {})
        until = options.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        budget = int(options.pop("max_gen_toks", 256))
        ids = self.tok_encode(context)[-(self.max_length - budget) :]
        kwargs: dict[str, Any] = {"max_new_tokens": budget, **self.method_args}
        temperature = options.pop("temperature", None)
        if options.pop("do_sample", False) or (temperature not in (None, 0, 0.0)):
            kwargs.update(do_sample=True, temperature=float(temperature or 1.0))
        if until:
            kwargs["stop_strings"] = until
        if self.method is not None:
            kwargs.update(custom_generate=self.method, trust_remote_code=self.trust_remote_code)
        if self.compile:
            kwargs["compile"] = True
        return ids, kwargs, until

    def _generated(self, prompts: list[list[int]], kwargs: dict, progress: bool = False) -> list[list[int]]:
        """The new tokens of each prompt, all through generate_batch where they can run together, else one by one."""
        if len(prompts) > 1 and self._batchable():
            outputs = self.model.generate_batch(prompts, progress_bar=progress, tokenizer=self.tokenizer, **kwargs)
            results = list(outputs.values())
            if all(r.error is None for r in results):
                return [r.generated_tokens for r in results]
        new = []
        for ids in prompts:
            prompt = torch.tensor([ids], device=self.model.device)
            sequence = self.model.generate(prompt, tokenizer=self.tokenizer, **kwargs)
            new.append(sequence[0, len(ids) :].tolist())
        return new

    def _batchable(self) -> bool:
        """Whether the method lets requests share continuous batching's steps: no method, or a hook-only one."""
        if self._batches is None:
            self._batches = self.method is None
            if isinstance(self.method, str):
                from ..hub_loader.method import load_method

                self._batches = load_method(self.method, self.trust_remote_code).generate is None
        return self._batches
