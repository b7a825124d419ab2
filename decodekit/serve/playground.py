"""The playground: a page at `/` to chat with the served model through any method it offers, and the two endpoints
the page reads beside /v1/chat/completions.

GET  /playground/methods  the methods a request may choose (registered plugins, the operator's --method entries),
                          each with the fields it declares and their defaults, and the methods of the machine's Hub
                          cache (listed, not served); a method's `facts` are `decodekit info`'s.
GET  /playground/search   Hub repositories tagged custom_generate (?q= words), as `decodekit search` finds them.
GET  /playground/info     `decodekit info`'s facts of a Hub method (?repo=), read without running it.
POST /playground/step     a chat completions body; the next token explained: the model's raw top tokens, what each
                          logits processor of the call changed (its top tokens before and after), the final
                          distribution and the token chosen. A method author sees there what their method does.

The page is plain HTML and JavaScript (playground.html, no build step); it asks /v1/chat/completions for replies with
logprobs and top_logprobs, so each token shows its probability and the alternatives.
"""

from __future__ import annotations

from pathlib import Path

import torch
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from ..batching import RequestStatus
from ..loading.tokenizer import special_token_texts
from .generation import Job, continued_chat_ids
from .protocol import (
    DECODEKIT_FORBIDDEN,
    INFRASTRUCTURE_PLUGINS,
    TOKEN_FIELDS,
    BadRequest,
    ChatCompletionRequest,
    chat_messages,
    own_loop_plugins,
)
from .served import Served, tokens_within

PAGE = Path(__file__).with_name("playground.html")
TOP_TOKENS = 8  # tokens shown per distribution


# Why a plugin that owns the decoding loop (or how logits are read) is refused under continuous batching.
OWN_LOOP = "its decoding loop cannot share the server's steps (decodekit generate runs it)"


def offered_methods(settings, plugins: set[str], infrastructure: frozenset) -> list[dict]:
    """[{"name", "kind", "fields": {field: default}, "forms", "refused": why or None}] of what a request's decodekit.method
    may name; `refused` for a plugin whose own decoding loop the server cannot run (beam search, contrastive
    search, speculative decoding, DoLa: /v1/chat/completions answers a 400 once its fields are set)."""
    from ..hub_loader.method import registered_for_call
    from ..registry.manager import call_hooks

    own_loop = own_loop_plugins()
    declared = {name: dict(fields) for name, fields in call_hooks("decodekit_config_fields")}
    offered = [
        {
            "name": name,
            "kind": "plugin",
            **fillable(declared.get(name, {})),
            "refused": OWN_LOOP if name in own_loop else None,
        }
        for name in sorted(plugins - infrastructure)
    ]
    for name, method in sorted(settings.methods.items()):
        with registered_for_call(method):
            own = dict(call_hooks("decodekit_config_fields")).get(method.plugin_name, {})
        offered.append(
            {"name": name, "kind": "method", **fillable(own), "refused": None, "facts": facts(method.source)}
        )
    served = {entry["name"] for entry in offered} | {m.source.label for m in settings.methods.values()}
    for info in cached_methods():  # listed with their facts; run only where the operator allowed them (--method)
        if info.spec not in served:
            served.add(info.spec)
            offered.append(
                {
                    "name": info.spec,
                    "kind": "cached",
                    "fields": {},
                    "forms": {},
                    "refused": NOT_ALLOWED,
                    "facts": facts_of_info(info),
                }  # fmt: skip
            )
    return offered


# Why a method of the machine's Hub cache is listed but cannot be chosen.
NOT_ALLOWED = (
    "in this machine's Hub cache, not among the methods the server was started with (decodekit serve --method)"
)


def facts(source) -> dict:
    """`decodekit info`'s facts of a served method's source (hub_loader/discover.py), for the page."""
    from ..hub_loader.discover import facts_of

    return facts_of_info(facts_of(source, source.label))


def facts_of_info(info) -> dict:
    return {
        "what": "a whole decoding loop" if info.loop else "hooks: " + (", ".join(info.hooks) or "none"),
        "arguments": info.arguments,
        "requirements": [{"requirement": r, "met": met} for r, met in info.requirements],
        "files": len(info.files),
        "pin": info.pin,
        "summary": info.summary or info.description,
    }


def cached_methods() -> list:
    from ..hub_loader.discover import cached_methods as cached

    return cached()


def fillable(fields: dict) -> dict:
    """{"fields": what a request can fill, with their defaults; "forms": the JSON form of those that take token ids}:
    a field that takes a Python object (a function, a model) is not offered."""
    kept = {name: value for name, value in fields.items() if name not in DECODEKIT_FORBIDDEN}
    return {"fields": jsonable(kept), "forms": {name: TOKEN_FIELDS[name] for name in kept if name in TOKEN_FIELDS}}


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


class Explanation:
    """What one step of a request did, as its Request.observer is told: the model's top tokens, each logits
    processor's top tokens before and after, and the final scores' (computed in the stepping thread as it goes)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.logits: list[dict] = []
        self.processors: list[dict] = []
        self.scores: list[dict] = []

    def observe(self, what: str | None, before: torch.Tensor, after: torch.Tensor) -> None:
        if what is None:  # the step's logits and the scores its token was chosen from
            self.logits, self.scores = top_tokens(before[0], self.tokenizer), top_tokens(after[0], self.tokenizer)
        else:
            self.processors.append(
                {
                    "processor": what,
                    "before": top_tokens(before[0], self.tokenizer),
                    "after": top_tokens(after[0], self.tokenizer),
                }
            )

    def answer(self, output, prompt_tokens: int) -> dict:
        chosen = output.generated_tokens[0]
        return {
            "prompt_tokens": prompt_tokens,
            "logits": self.logits,
            "processors": self.processors,
            "scores": self.scores,
            "chosen": {"id": chosen, "text": self.tokenizer.decode([chosen])},
        }


def router(served: Served) -> APIRouter:
    routes = APIRouter()

    @routes.get("/")
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @routes.get("/playground/methods")
    async def methods():
        offered = await run_in_threadpool(offered_methods, served.settings, served.plugins(), INFRASTRUCTURE_PLUGINS)
        special = special_token_texts(served.tokenizer)
        return {"model": served.settings.model_name, "methods": offered, "special_tokens": special}

    @routes.get("/playground/search")
    async def search(request: Request):
        """Hub repositories tagged custom_generate matching ?q= (decodekit search): found, not served (the server
        runs only what its operator allowed)."""
        from ..hub_loader.discover import search_methods

        query = request.query_params.get("q") or None
        try:
            found = await run_in_threadpool(search_methods, query, "downloads", 10)
        except (OSError, ValueError) as error:
            return served.refused(BadRequest(f"search: {error}", "q", 502, "upstream_error"))
        return {"results": [vars(item) for item in found]}

    @routes.get("/playground/info")
    async def info(request: Request):
        """`decodekit info`'s facts of ?repo= (a Hub repo id): its custom_generate/ and README downloaded into the
        machine's Hub cache, nothing of it run; listed, not served."""
        from ..hub_loader.discover import describe_method
        from ..hub_loader.source import is_hub_id

        repo = request.query_params.get("repo") or ""
        if not is_hub_id(repo):
            return served.refused(BadRequest(f"repo={repo!r} is invalid; expected a Hub repo id 'org/name'.", "repo"))
        try:
            found = await run_in_threadpool(describe_method, repo)
        except (OSError, ValueError) as error:
            return served.refused(BadRequest(f"info: {error}", "repo", 502, "upstream_error"))
        return {"repo": repo, "facts": facts_of_info(found)}

    @routes.post("/playground/step")
    async def step(request: Request):
        """A chat completions body -> the next token explained. It runs as one request of the manager, with one new
        token: the same admission, queue, cache budget and refusals as /v1/chat/completions."""
        try:
            body = await served.body_of(request, ChatCompletionRequest)
            messages = chat_messages(body.messages)
            fields = body.to_fields(served.settings, served.plugins(), served.vocab, served.eos, 1)
            fields.update(max_new_tokens=1, num_return_sequences=1)
            explanation = Explanation(served.tokenizer)
            job = Job(
                served.manager,
                served.tokenizer,
                body.model_copy(update={"stream": False}),
                served.settings,
                {**fields, "observer": explanation.observe},
            )

            def prompt_of():
                tokens_within(served.tokenizer, [m["content"] for m in messages], served.context)
                return continued_chat_ids(served.tokenizer, messages, body)

            await job.add(prompt_of)
            output = await job.final(request)
            if output is None:
                return Response(status_code=499)
            if output.status != RequestStatus.FINISHED or not output.generated_tokens:
                return job.whole(output)  # the error or cancellation, as the completions endpoint answers it
            return explanation.answer(output, len(job.prompt_ids))
        except BadRequest as error:
            return served.refused(error)

    return routes
