"""`decodekit chat`: a multi-turn chat in the terminal, through the model's chat template.

A ChatSession holds the conversation (system message, turns) and the call's generate() keywords; `run` reads lines
and answers each message with a streamed reply. Lines that start with "/" are commands (COMMANDS). What a command
changes is checked before it takes effect, as the command line's flags are: a bad /set or /method leaves the session
as it was.
"""

from __future__ import annotations

import re
import sys
from typing import Callable

from .core.streamers import TextStreamer

COMMANDS = {
    "/help": "this list",
    "/reset": "forget the conversation (the system message stays)",
    "/system TEXT": "set the system message and start over (/system alone removes it)",
    "/method DIR_OR_REPO": "answer with a custom_generate method (/method off: the built-in generate)",
    "/set KEY=VALUE": "set a generation config field for the next replies (VALUE read as JSON when it parses)",
    "/settings": "show the fields set and the method in use",
    "/exit": "end the chat (also /quit, or Ctrl-D)",
}


class TrustOffer(ValueError):
    """The trust gate refused a method the chat could trust for itself: its refusal (the files and their hashes),
    the method and the revision a pin would hold."""

    def __init__(self, message: str, method: str, revision: str):
        super().__init__(message)
        self.method, self.revision = method, revision


class ChatSession:
    """The conversation with `model` through `tokenizer`'s chat template. `fields`: generate() keywords of every
    reply; `method`: a custom_generate method for the replies, run with trust_remote_code=`trust_for(method)`;
    `check(fields, method)` raises ValueError for what the command line would refuse (TrustOffer where trusting the
    method would do, which /method then offers, and `pin(method, revision)` records for the chat); `out`: where
    replies go; `seed`: each reply's sampling seed (generate(seed=))."""

    def __init__(
        self,
        model,
        tokenizer,
        fields: dict,
        system: str | None = None,
        method: str | None = None,
        trust_for: Callable[[str], object] = lambda method: None,
        check: Callable[[dict, str | None], None] = lambda fields, method: None,
        out=None,
        seed: int | None = None,
        pin: Callable[[str, str], None] | None = None,
    ):
        self.model, self.tokenizer, self.seed = model, tokenizer, seed
        self.fields, self.system, self.method = dict(fields), system, method
        self.trust_for, self.check, self.pin = trust_for, check, pin
        self.read: Callable[[str], str] = input
        self.out = out or sys.stdout
        self.turns: list[dict[str, str]] = []

    # --- the conversation -------------------------------------------------------------------------------------

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def reply(self, text: str) -> str:
        """The assistant's answer to the user's `text`, streamed to `out` as it is generated and kept in the
        conversation. Ctrl-C stops it: the message and the partial answer are then dropped, and KeyboardInterrupt
        is raised for the caller to say so."""
        import torch

        from .loading.tokenizer import chat_ids

        self.turns.append({"role": "user", "content": text})
        try:
            ids = torch.tensor([chat_ids(self.tokenizer, self.messages())], device=self.model.device)
            self.check_context(ids.shape[1])
            streamer = _Printer(self.tokenizer, self.out)
            method = (
                {"custom_generate": self.method, "trust_remote_code": self.trust_for(self.method)}
                if self.method
                else {}
            )
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                streamer=streamer,
                tokenizer=self.tokenizer,
                seed=self.seed,
                **method,
                **self.fields,
            )
        except BaseException:
            self.turns.pop()
            raise
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        answer = self.tokenizer.decode(sequences[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
        if not streamer.wrote:  # a method that does not stream: the whole answer at the end
            self.out.write(shown(answer))
        self.out.write("\n")
        self.out.flush()
        self.turns.append({"role": "assistant", "content": answer.strip()})
        return answer

    def check_context(self, length: int) -> None:
        """ValueError before any forward where the conversation of `length` tokens leaves the model no position to
        answer in (a pasted file, say: a prompt past the context ran until memory ran out)."""
        context = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        if isinstance(context, int) and length >= context:
            raise ValueError(
                f"the conversation is {length} tokens with this message, and the model's context is {context} "
                "positions (max_position_embeddings): send a shorter message, or /reset to start over."
            )

    # --- commands -------------------------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Runs the command on `line`; False when the chat should end. ValueError for an invalid one, whose effect
        is then none."""
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.say("\n".join(f"  {usage:<22} {what}" for usage, what in COMMANDS.items()))
        elif name == "/reset":
            self.turns.clear()
            self.say("(the conversation is cleared)")
        elif name == "/system":
            self.system = rest or None
            self.turns.clear()
            self.say("(system message set; the conversation starts over)" if rest else "(no system message)")
        elif name == "/method":
            method = None if rest in ("", "off") else rest
            try:
                self.check(self.fields, method)
            except TrustOffer as offer:
                if self.pin is None or not self.asked_to_trust(offer):
                    raise
                self.pin(offer.method, offer.revision)
                self.check(self.fields, method)
            self.method = method
            self.say(f"(replies come from {method})" if method else "(replies come from the built-in generate)")
        elif name == "/set":
            key, value = parse_setting(rest)
            fields = {**self.fields, key: value}
            sampling = self.turns_sampling_on(key, fields)
            self.check(fields, self.method)
            self.fields = fields
            self.say(f"({key} = {value!r}" + ("; sampling is on: do_sample = True)" if sampling else ")"))
        elif name == "/settings":
            shown = ", ".join(f"{k}={v!r}" for k, v in sorted(self.fields.items())) or "none"
            self.say(f"(fields: {shown}; method: {self.method or 'built-in'}; system: {self.system!r})")
        else:
            raise ValueError(
                f"{name} is not a command; the commands are {', '.join(c.split()[0] for c in COMMANDS)} "
                "(/help says what each does)."
            )
        return True

    def asked_to_trust(self, offer: TrustOffer) -> bool:
        """Shows the gate's refusal (the method's files and hashes) and asks whether to run that revision in this
        chat; only "y" or "yes" says so (end of input or Ctrl-C: no)."""
        self.say(str(offer))
        try:
            answer = self.read(f"Run {offer.method} at revision {offer.revision[:12]} in this chat? [y/N] ")
        except (EOFError, KeyboardInterrupt):
            return False
        return answer.strip().lower() in ("y", "yes")

    def turns_sampling_on(self, key: str, fields: dict) -> bool:
        """Whether setting `key` turns sampling on in `fields` (done here): a field that changes sampling alone
        (temperature, top_p, ...) set while the replies do not sample takes effect, rather than being ignored with a
        warning. `/set do_sample=false` afterwards makes the replies greedy again."""
        from .core.generate import SAMPLING_ONLY

        if key not in SAMPLING_ONLY or fields.get("do_sample") is True:
            return False
        if "do_sample" not in fields and getattr(getattr(self.model, "generation_config", None), "do_sample", False):
            return False
        fields["do_sample"] = True
        return True

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # --- the loop ------------------------------------------------------------------------------------------

    def run(self, read: Callable[[str], str] = input) -> int:
        """Reads lines with `read(prompt)` until /exit or end of input; returns the exit code (0)."""
        self.read = read
        self.say("Chatting with the model: type a message and press Enter; /help lists the commands, Ctrl-D ends.")
        while True:
            try:
                line = read("> ")
            except EOFError:
                self.say("")
                return 0
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell gives
                self.say("")
                continue
            except UnicodeDecodeError:  # a terminal or pipe whose bytes are not UTF-8
                self.say("error: that line is not valid UTF-8; type it again in UTF-8.")
                continue
            if not valid_text(line):  # what Python made of bytes it could not decode (surrogate escapes)
                self.say("error: that line is not valid UTF-8; type it again in UTF-8.")
                continue
            if not line.strip():
                continue
            try:
                if line.lstrip().startswith("/"):
                    if not self.command(line):
                        return 0
                else:
                    self.reply(line)
            except KeyboardInterrupt:
                self.say("\n(stopped; that message is forgotten)")
            except (ValueError, TypeError, ImportError, OSError) as error:
                self.say(f"error: {error}")


def valid_text(line: str) -> bool:
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_setting(text: str) -> tuple[str, object]:
    """KEY=VALUE of /set, VALUE read as JSON where it parses (5, 0.5, true, [1, 2]), else as text."""
    import json

    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ValueError(
            f"/set {text!r} is invalid; expected /set KEY=VALUE with KEY a field name, e.g. /set temperature=0.7."
        )
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value.strip()


def shown(text: str) -> str:
    """`text` as the terminal should show a model's words: control characters (escape sequences that would set the
    window title, colours or the clipboard, a carriage return that overwrites the line) written as escapes, such as
    \\x1b; newlines and tabs kept."""
    return CONTROL.sub(lambda c: c.group().encode("unicode_escape").decode("ascii"), text)


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class _Printer(TextStreamer):
    """Writes the reply's text to `out` as it comes (the prompt skipped); `wrote`: whether any came."""

    def __init__(self, tokenizer, out):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out, self.wrote = out, False

    def on_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.wrote = True
            self.out.write(shown(text))
            self.out.flush()
