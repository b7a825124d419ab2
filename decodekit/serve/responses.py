"""The answers of /v1/completions and /v1/chat/completions as pydantic models, OpenAI's shapes: a whole completion, a
chat completion, and the chunk each streams. `Answers` builds them for one request's endpoint; it is the one place
that knows which shape an endpoint answers with. The tests validate what goes out against the openai package's own
types."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

# What a masked token's logprob reads as (OpenAI's floor): JSON has no -Infinity, and a browser's JSON.parse refuses it.
MASKED_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    """`logprob`, or the floor for a token a constraint or warper masked (-inf, or NaN: the comparison is false)."""
    return logprob if logprob >= MASKED_LOGPROB else MASKED_LOGPROB


class Shape(BaseModel):
    def out(self) -> dict[str, Any]:
        """The JSON object sent: every field set when it was made (an optional one left out is absent, not null)."""
        return self.model_dump(exclude_unset=True)


class Usage(Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Shape):
    content: list[TokenLogprob]


class CompletionLogprobs(Shape):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token, which nothing comes before
    text_offset: list[int]
    top_logprobs: list[dict[str, float] | None] | None


class ToolFunction(Shape):
    name: str
    arguments: str


class ToolCall(Shape):
    id: str
    type: Literal["function"]
    function: ToolFunction
    index: int | None = None  # a streamed call's place in the list


class Message(Shape):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class CompletionChoice(Shape):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class ChatChoice(Shape):
    index: int
    message: Message
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatChunkChoice(Shape):
    index: int
    delta: Message
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class Answer(Shape):
    id: str
    created: int
    model: str
    usage: Usage | None = None


class Completion(Answer):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletion(Answer):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ChatCompletionChunk(Answer):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class Answers:
    """The answers of one request: `chat` picks the endpoint's shapes; `id`, `created` and `model` go in each."""

    def __init__(self, chat: bool, id: str, created: int, model: str):
        self.chat, self.id, self.created, self.model = chat, id, created, model

    def choice(
        self,
        index: int,
        text: str | None,
        reason: str | None,
        logprobs: ChatLogprobs | CompletionLogprobs | None,
        delta: bool,
        tool_calls: list[dict] | None = None,
    ) -> Shape:
        """One row's choice: a whole one, or a streamed piece (`delta`); `tool_calls` as tools.ToolPlan parses them."""
        if not self.chat:
            return CompletionChoice(index=index, text=text or "", finish_reason=reason, logprobs=logprobs)
        message = Message(role="assistant", content=text)
        if tool_calls:
            calls = [ToolCall(**call, index=i) if delta else ToolCall(**call) for i, call in enumerate(tool_calls)]
            message = Message(role="assistant", content=text, tool_calls=calls)
        if delta:
            return ChatChunkChoice(index=index, delta=message, finish_reason=reason, logprobs=logprobs)
        return ChatChoice(index=index, message=message, finish_reason=reason, logprobs=logprobs)

    def logprobs(
        self, words: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]] | None, offset: int
    ) -> ChatLogprobs | CompletionLogprobs:
        """The logprobs of a row's tokens (`words`, decoded one by one, the first at character `offset` of the
        text): each chosen token's logprob and, where asked, the top alternatives [(word, logprob)] at its step."""
        if self.chat:
            return ChatLogprobs(
                content=[
                    TokenLogprob(
                        token=word,
                        logprob=value,
                        bytes=list(word.encode()),
                        top_logprobs=[TopLogprob(token=w, logprob=v, bytes=list(w.encode())) for w, v in top],
                    )
                    for word, value, top in zip(words, logprobs, tops or [[]] * len(words))
                ]
            )
        offsets = []
        for word in words:
            offsets.append(offset)
            offset += len(word)
        return CompletionLogprobs(
            tokens=words,
            token_logprobs=logprobs,
            text_offset=offsets,
            top_logprobs=[dict(top) for top in tops] if tops is not None else None,
        )

    def whole(self, choices: list[Shape], usage: Usage) -> Answer:
        fields = dict(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        if self.chat:
            return ChatCompletion(object="chat.completion", **fields)
        return Completion(object="text_completion", **fields)

    def chunk(self, choices: list[Shape], usage: Usage | None = None) -> Answer:
        """A streamed chunk: choices' pieces, or (the last, where the request asked) no choices and the usage."""
        fields = dict(id=self.id, created=self.created, model=self.model, choices=choices)
        if usage is not None:
            fields["usage"] = usage
        if self.chat:
            return ChatCompletionChunk(object="chat.completion.chunk", **fields)
        return Completion(object="text_completion", **fields)
