"""Tool calling for /v1/chat/completions: `tools` and `tool_choice` as OpenAI defines them.

- The tool definitions reach the model through its chat template when the template takes `tools` (Qwen2.5,
  Llama 3.1, Hermes, ...). A template that does not (SmolLM2's) gets them in its system message, in the Hermes
  format: the functions as JSON inside <tools></tools>, and the instruction to answer a call as
  <tool_call>{"name": ..., "arguments": {...}}</tool_call>. Earlier assistant calls and `role: "tool"` results in
  the history are written the same way for such templates.
- A named `tool_choice` constrains the output to that function's `parameters` schema (the output is the call's
  arguments); `"required"` constrains it to one call of any tool, `{"name": ..., "arguments": ...}`. Both through
  decodekit's structured output, so the call is valid JSON for the schema whatever the model.
- `"auto"` lets the model choose and parses the calls it makes in the Hermes format (<tool_call>{...}</tool_call>,
  one or several); text outside them is the message's content. Other models' formats are not parsed.
- `"none"`: the tools are not shown to the model, as if there were none.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .protocol import BadRequest, check_schema_depth

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit on the functions of one request
SYSTEM = (
    "You may call one or more functions to help with the user's request. The functions are described, as "
    "JSON schemas, inside <tools></tools>:\n<tools>\n{tools}\n</tools>\nTo call a function, answer with a JSON "
    'object of its name and arguments inside <tool_call></tool_call>: <tool_call>{{"name": <function name>, '
    '"arguments": <arguments object>}}</tool_call>'
)


@dataclass
class ToolPlan:
    functions: list[dict]  # each {"name", "description"?, "parameters"?}
    choice: str  # "auto", "required", or the name a call is forced to
    calls: list[dict] = field(default_factory=list)

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def constraint(self) -> dict | None:
        """The json_schema field forcing the output (named: the arguments; required: one call), None for auto."""
        if self.choice == "auto":
            return None
        if self.choice == "required":
            return {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": f["name"]}, "arguments": _params(f)},
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                    for f in self.functions
                ]
            }
        return _params(next(f for f in self.functions if f["name"] == self.choice))

    def tool_calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of the model's output text."""
        if self.choice == "required":
            try:
                call = json.loads(text)
                return None, [_call(call["name"], call["arguments"])]
            except (ValueError, KeyError, TypeError):
                return text, []  # cut off by max_tokens before the call was whole
        if self.choice != "auto":
            return None, [_call(self.choice, text)]
        calls, spans = [], call_spans(text)
        for _, _, inner in spans:
            try:
                call = json.loads(inner)
                calls.append(_call(call["name"], call.get("arguments", {})))
            except (ValueError, KeyError, TypeError):
                continue  # not a call: stays in the text
        if not calls:
            return text or None, calls
        kept, at = [], 0
        for start, end, _ in spans:
            kept.append(text[at:start])
            at = end
        content = ("".join(kept) + text[at:]).strip()
        return content or None, calls


def call_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, what is inside, stripped) of each <tool_call>...</tool_call> in `text`, each closed by the first
    closing tag after it: one scan, where a regular expression with whitespace on both sides of a lazy group
    backtracked cubically (a long output of tags and spaces held the event loop for most of a minute)."""
    spans, at = [], 0
    while (start := text.find(OPEN, at)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            break
        spans.append((start, end + len(CLOSE), text[start + len(OPEN) : end].strip()))
        at = end + len(CLOSE)
    return spans


def _params(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": text}}


def plan_tools(request) -> ToolPlan | None:
    """A ChatCompletionRequest's tools and tool_choice, checked; None when no tool may be called."""
    tools, choice = request.tools, request.tool_choice
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools: pass the functions the model may call.", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise BadRequest('tools must be a list of {"type": "function", "function": {"name": ..., ...}}.', "tools")
    if len(tools) > MAX_TOOLS:
        raise BadRequest(
            f"tools has {len(tools)} functions; this server takes at most {MAX_TOOLS}, as OpenAI.", "tools"
        )
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(
                f'tools[{i}] is invalid; expected {{"type": "function", "function": {{"name": '
                '"...", "description": "...", "parameters": {...JSON schema...}}}.',
                f"tools[{i}]",
            )
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object.", f"tools[{i}]")
        check_schema_depth(function.get("parameters"), f"tools[{i}].function.parameters")
        functions.append(function)
    names = [f["name"] for f in functions]
    if choice is None or choice == "auto":
        return ToolPlan(functions, "auto")
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan(functions, "required")
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or name not in names:
        raise BadRequest(
            f'tool_choice={choice!r} is invalid; expected "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": NAME}}}} with NAME one of {names}.',
            "tool_choice",
        )
    return ToolPlan(functions, name)


def takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def messages_with_tools(messages: list[dict], plan: ToolPlan | None, tokenizer) -> tuple[list[dict], dict[str, Any]]:
    """(messages, chat template arguments) for a request: the tools through the template where it takes them,
    else in the Hermes format in the system message; earlier calls and results in the history as text for a
    template without tools."""
    if takes_tools(tokenizer):
        return messages, ({"tools": [{"type": "function", "function": f} for f in plan.functions]} if plan else {})
    out = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            content += "".join(
                f"<tool_call>{json.dumps({'name': c['function']['name'], 'arguments': _json(c['function']['arguments'])})}</tool_call>"
                for c in message["tool_calls"]
            )
        if message["role"] == "tool":
            content = f"<tool_response>{content}</tool_response>"
        out.append({"role": message["role"], "content": content})
    if plan is not None:
        tools = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in plan.functions)
        system = SYSTEM.format(tools=tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}


def _json(text):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text
