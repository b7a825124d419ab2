"""decodekit chat, driven through a pseudo-terminal as a person types into it, and ChatSession in process."""

from __future__ import annotations

import io
import os
import select
import subprocess
import sys
import time

import pytest
import torch

from decodekit.chat import ChatSession, parse_setting
from helpers import PATIENCE


PROMPT = "\n> "  # at the start of a line: "> " alone is in messages too ("a number > 0")


class Terminal:
    """A process on a pseudo-terminal: what it prints is read as a terminal shows it."""

    def __init__(self, argv: list[str]):
        import pty

        self.master, slave = pty.openpty()
        self.process = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True, env={**os.environ, "TERM": "dumb"}
        )
        os.close(slave)
        self.screen = ""

    def wait_for(self, text: str, timeout: float = PATIENCE) -> str:
        """Everything printed until `text` appears (and `text`), consumed."""
        end = time.monotonic() + timeout
        while text not in self.screen:
            left = end - time.monotonic()
            assert left > 0 and self.process.poll() is None, f"never printed {text!r}; printed:\n{self.screen[-3000:]}"
            if select.select([self.master], [], [], min(left, 1.0))[0]:
                try:
                    self.screen += os.read(self.master, 4096).decode("utf-8", "replace").replace("\r\n", "\n")
                except OSError:  # the process closed the terminal
                    pass
        shown, _, self.screen = self.screen.partition(text)
        return shown + text

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")

    def close(self) -> int:
        os.write(self.master, b"\x04")  # Ctrl-D at an empty prompt
        code = self.process.wait(timeout=PATIENCE)
        os.close(self.master)
        return code


def test_a_chat_in_a_terminal_keeps_the_conversation_and_takes_commands(default_model, tmp_path):
    from methods import HOOK_METHOD, write_method

    method = write_method(tmp_path / "ban", HOOK_METHOD)
    term = Terminal(
        [
            sys.executable,
            "-m",
            "decodekit.cli",
            "chat",
            "--max-new-tokens",
            "12",
            "--system",
            "Answer in one short sentence.",
            "--trust-remote-code",
        ]
    )
    try:
        term.wait_for("Ctrl-D ends." + PROMPT)
        term.type("What is the capital of France?")
        first = term.wait_for(PROMPT)
        assert "Paris" in first, first
        term.type("/set temperature=hot")
        assert "error: generation config: --temperature 'hot' is invalid" in term.wait_for(PROMPT)
        term.type("/set repetition_penalty=1.1")
        assert "(repetition_penalty = 1.1)" in term.wait_for(PROMPT)
        term.type("/method " + str(method))
        assert f"(replies come from {method})" in term.wait_for(PROMPT)
        term.type("/set banned_token=5")  # the method's own field, known once it is chosen
        assert "(banned_token = 5)" in term.wait_for(PROMPT)
        term.type("/settings")
        settings = term.wait_for(PROMPT)
        assert "banned_token=5" in settings and "repetition_penalty=1.1" in settings and str(method) in settings
        term.type("/frobnicate")
        assert "/frobnicate is not a command" in term.wait_for(PROMPT)
        term.type("/reset")
        assert "(the conversation is cleared)" in term.wait_for(PROMPT)
        assert term.close() == 0
    finally:
        if term.process.poll() is None:
            term.process.kill()


def test_the_conversation_goes_through_the_chat_template_turn_by_turn(default_model):
    model, tokenizer = default_model
    out = io.StringIO()
    session = ChatSession(model, tokenizer, {"max_new_tokens": 10}, system="Be brief.", out=out)
    first = session.reply("What is the capital of France?")
    session.reply("And of Italy?")
    assert [m["role"] for m in session.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert session.messages()[2]["content"] == first.strip() and "Paris" in first
    # The second reply is what generate() gives for the whole conversation through the template.
    from decodekit.loading.tokenizer import chat_ids

    ids = torch.tensor([chat_ids(tokenizer, session.messages()[:4])])
    expected = model.generate(ids, max_new_tokens=10)[0, ids.shape[1] :].tolist()
    assert session.messages()[4]["content"] == tokenizer.decode(expected, skip_special_tokens=True).strip()
    assert out.getvalue().count("\n") == 2  # each reply streamed, then its line ends
    session.command("/reset")
    assert session.messages() == [{"role": "system", "content": "Be brief."}]


def test_a_refused_setting_leaves_the_session_as_it_was():
    def check(fields, method):
        if fields.get("top_p", 1) > 1:
            raise ValueError("top_p=2 is invalid")

    session = ChatSession(None, None, {"top_p": 0.9}, check=check, out=io.StringIO())
    with pytest.raises(ValueError, match="top_p=2 is invalid"):
        session.command("/set top_p=2")
    assert session.fields == {"top_p": 0.9}
    with pytest.raises(ValueError, match="expected /set KEY=VALUE"):
        parse_setting("no equals sign")
    assert parse_setting('stop_strings=["\\n"]') == ("stop_strings", ["\n"])
    assert session.command("/exit") is False


def test_a_seeded_chat_samples_the_same_reply_again(default_model):
    model, tokenizer = default_model
    replies = []
    for _ in range(2):
        session = ChatSession(
            model, tokenizer, {"max_new_tokens": 12, "do_sample": True, "temperature": 1.5}, out=io.StringIO(), seed=7
        )
        replies.append(session.reply("Tell me a word."))
    assert replies[0] == replies[1]
    other = ChatSession(
        model, tokenizer, {"max_new_tokens": 12, "do_sample": True, "temperature": 1.5}, out=io.StringIO(), seed=8
    ).reply("Tell me a word.")
    assert other != replies[0]


def test_a_sampling_field_set_on_greedy_replies_turns_sampling_on_and_takes_effect(default_model):
    model, tokenizer = default_model
    assert not model.generation_config.do_sample  # the replies are greedy by default
    out = io.StringIO()
    session = ChatSession(model, tokenizer, {"max_new_tokens": 12}, out=out, seed=3)
    greedy = session.reply("Tell me a word.")
    session.command("/reset")
    session.command("/set temperature=5.0")  # was accepted, then ignored with a warning
    assert session.fields["do_sample"] is True and "sampling is on: do_sample = True" in out.getvalue()
    assert session.reply("Tell me a word.") != greedy
    session = ChatSession(model, tokenizer, {"max_new_tokens": 12, "do_sample": False}, out=out)  # the CLI's
    session.command("/set top_p=0.5")
    assert session.fields == {"max_new_tokens": 12, "do_sample": True, "top_p": 0.5}


def test_control_characters_of_a_reply_are_shown_not_obeyed():
    from decodekit.chat import _Printer, shown

    title, clipboard = "\x1b]0;owned\x07", "\x1b]52;c;ZWNobyBoaQ==\x07"
    assert shown(f"a{title}b\n\tc\r{clipboard}\x9b") == "a\\x1b]0;owned\\x07b\n\tc\\r\\x1b]52;c;ZWNobyBoaQ==\\x07\\x9b"
    out = io.StringIO()
    _Printer(None, out).on_text("red: \x1b[31mX")
    assert out.getvalue() == "red: \\x1b[31mX"


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on():
    lines = iter([b"caf\xe9".decode("utf-8", "surrogateescape"), "/exit"])  # what Python makes of a Latin-1 byte
    out = io.StringIO()
    session = ChatSession(None, None, {}, out=out)
    assert session.run(read=lambda prompt: next(lines)) == 0
    assert "that line is not valid UTF-8" in out.getvalue() and session.turns == []


def test_the_trust_gate_s_advice_in_a_chat_names_the_flag_and_the_pin_file(tmp_path, monkeypatch):
    from decodekit.cli.commands import cmd_chat
    from decodekit.cli.parser import build_parser
    from methods import HOOK_METHOD, write_method

    method = write_method(tmp_path / "ban", HOOK_METHOD)
    monkeypatch.setenv("DECODEKIT_CONFIG_DIR", str(tmp_path / "config"))
    told = []

    class Session:  # the chat as cmd_chat builds it, without a model: only its check of /method is used here
        def __init__(self, model, tokenizer, fields, check, **kwargs):
            self.check = check

        def run(self):
            with pytest.raises(ValueError) as refused:
                self.check({}, str(method))
            told.append(str(refused.value))
            return 0

    monkeypatch.setattr("decodekit.chat.ChatSession", Session)
    monkeypatch.setattr("decodekit.cli.commands.load_model_of", lambda args, say=False: (None, None))
    assert cmd_chat(build_parser().parse_args(["chat"])) == 0
    assert "pass --trust-remote-code" in told[0] and "trust_remote_code=" not in told[0]
    assert f"the line '{method} " in told[0] and str(tmp_path / "config" / "trusted_revisions.txt") in told[0]


def test_a_message_past_the_model_s_context_is_refused_before_any_forward(default_model, monkeypatch):
    # Before: a 2 MB line was told "The prompt has 400031 tokens" and run anyway, until memory ran out.
    model, tokenizer = default_model
    session = ChatSession(model, tokenizer, {"max_new_tokens": 4}, out=io.StringIO())
    session.reply("Hi")
    forwards = []
    monkeypatch.setattr(type(model.module), "forward", lambda *a, **k: forwards.append(1))
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"model's context is {context} positions"):
        session.reply("word " * context)
    assert not forwards and len(session.messages()) == 2  # the long message forgotten, the conversation kept


@pytest.mark.parametrize("answer", ["y", "n"])
def test_method_in_a_chat_offers_to_trust_the_folder_showing_its_hashes(
    default_model, tmp_path, monkeypatch, capsys, answer
):
    # Before: /method ./dir only said to restart the chat with --trust-remote-code.
    from decodekit.cli.commands import cmd_chat
    from decodekit.cli.parser import build_parser
    from methods import HOOK_METHOD, write_method

    method = write_method(tmp_path / "ban", HOOK_METHOD)
    monkeypatch.setenv("DECODEKIT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setattr("decodekit.cli.commands.load_model_of", lambda args, say=False: default_model)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/method {method}\n{answer}\n/settings\n"))
    assert cmd_chat(build_parser().parse_args(["chat"])) == 0
    out = capsys.readouterr().out
    assert "generate.py  sha256:" in out and f"Run {method} at revision " in out
    if answer == "y":
        assert f"(replies come from {method})" in out and f"method: {method}" in out
    else:
        assert "(replies come from" not in out and "method: built-in" in out
