"""The playground: a page at `/` to chat with the served model through any method it offers, and the two endpoints
the page reads beside /v1/chat/completions.

GET  /playground/methods  the methods a request may choose (registered plugins, the operator's --method entries),
                          each with the fields it declares and their defaults.
POST /playground/step     a chat completions body; the next token explained: the model's raw top tokens, what each
                          logits processor of the call changed (its top tokens before and after), the final
                          distribution and the token chosen. A method author sees there what their method does.

The page is plain HTML and JavaScript (playground.html, no build step); it asks /v1/chat/completions for replies with
logprobs and top_logprobs, so each token shows its probability and the alternatives.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from ..loading.tokenizer import chat_ids
from .protocol import INFRASTRUCTURE_PLUGINS, BadRequest, ChatCompletionRequest, chat_messages
from .served import Served, tokens_within

PAGE = Path(__file__).with_name("playground.html")
TOP_TOKENS = 8  # tokens shown per distribution


def offered_methods(settings, plugins: set[str], infrastructure: frozenset) -> list[dict]:
    """[{"name", "kind", "fields": {field: default}}] of what a request's decodekit.method may name."""
    from ..hub_loader.method import registered_for_call
    from ..registry.manager import call_hooks

    declared = {name: dict(fields) for name, fields in call_hooks("decodekit_config_fields")}
    offered = [
        {"name": name, "kind": "plugin", "fields": jsonable(declared.get(name, {}))}
        for name in sorted(plugins - infrastructure)
    ]
    for name, method in sorted(settings.methods.items()):
        with registered_for_call(method):
            own = dict(call_hooks("decodekit_config_fields")).get(method.plugin_name, {})
        offered.append({"name": name, "kind": "method", "fields": jsonable(own)})
    return offered


def jsonable(fields: dict) -> dict:
    """The defaults a page can show: numbers, strings, booleans, None and lists of them; others as their repr."""

    def plain(value):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
            return list(value)
        return repr(value)

    return {name: plain(value) for name, value in fields.items()}


def top_tokens(scores: torch.Tensor, tokenizer, k: int = TOP_TOKENS) -> list[dict]:
    """The `k` best tokens of one row of scores [V]: id, text, score (None for -inf) and probability."""
    scores = scores.float()
    probs = torch.softmax(scores, dim=-1)
    best = torch.topk(scores, min(k, scores.shape[-1])).indices.tolist()
    out = []
    for token in best:
        score = float(scores[token])
        out.append(
            {
                "id": token,
                "text": tokenizer.decode([token]),
                "score": score if score > float("-inf") else None,
                "prob": float(probs[token]) if torch.isfinite(probs[token]) else 0.0,
            }
        )
    return out


def explain_step(model, tokenizer, ids: list[int], arguments: dict) -> dict:
    """The next token after `ids` as the call `arguments` (add_request's, from the chat body) would choose it, with
    what each logits processor did to the scores."""
    from ..batching.request import REQUEST_ARGUMENTS
    from ..core.processors import observe_processors
    from ..hub_loader.method import LoadedMethod, registered_for_call

    fields = {k: v for k, v in arguments.items() if k not in REQUEST_ARGUMENTS}
    fields.update(max_new_tokens=1, num_return_sequences=1)
    method = arguments.get("custom_generate")
    steps: list[dict] = []

    def observe(what: str, before: torch.Tensor, after: torch.Tensor) -> None:
        steps.append(
            {"processor": what, "before": top_tokens(before[0], tokenizer), "after": top_tokens(after[0], tokenizer)}
        )

    registered = registered_for_call(method) if isinstance(method, LoadedMethod) else contextlib.nullcontext()
    with registered, observe_processors(observe):
        out = model.generate(
            torch.tensor([ids], device=model.device),
            tokenizer=tokenizer,
            seed=arguments.get("seed"),
            return_dict_in_generate=True,
            output_logits=True,
            output_scores=True,
            **fields,
        )
    chosen = int(out.sequences[0, -1])
    return {
        "prompt_tokens": len(ids),
        "logits": top_tokens(out.logits[0][0], tokenizer),
        "processors": steps,
        "scores": top_tokens(out.scores[0][0], tokenizer),
        "chosen": {"id": chosen, "text": tokenizer.decode([chosen])},
    }


def router(served: Served) -> APIRouter:
    routes = APIRouter()

    @routes.get("/")
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @routes.get("/playground/methods")
    async def methods():
        offered = await run_in_threadpool(offered_methods, served.settings, served.plugins(), INFRASTRUCTURE_PLUGINS)
        return {"model": served.settings.model_name, "methods": offered}

    @routes.post("/playground/step")
    async def step(request: Request):
        """A chat completions body -> the next token explained."""
        try:
            body = await served.body_of(request, ChatCompletionRequest)
            messages = chat_messages(body.messages)
            fields = body.to_fields(served.settings, served.plugins(), served.vocab, served.eos, 1)  # one token

            def explain():
                tokens_within(served.tokenizer, [m["content"] for m in messages], served.context)
                ids = chat_ids(served.tokenizer, messages, content_as_text=True)
                try:
                    return explain_step(served.manager.model, served.tokenizer, ids, fields)
                except (ValueError, TypeError) as error:  # the call's own values, as add_request would say
                    raise BadRequest(str(error)) from None

            return await run_in_threadpool(explain)
        except BadRequest as error:
            return served.refused(error)

    return routes
