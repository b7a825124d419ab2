"""`--config FILE`: flags read from a YAML, TOML or JSON file, checked and merged under the command line's."""

from __future__ import annotations

import argparse
import json
import os

from .arguments import CLIError


CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


MAX_CONFIG_BYTES = 1 << 20  # a file of flags: far more than any holds, far less than a mistaken path could


def read_config(path: str) -> dict:
    """The mapping in `path`: YAML (.yaml, .yml), TOML (.toml) or JSON (.json), a regular file of at most
    MAX_CONFIG_BYTES; YAML without aliases; values JSON can hold (strings, numbers, booleans, lists, mappings)."""
    from pathlib import Path

    suffix = Path(path).suffix.lower()
    if suffix not in CONFIG_SUFFIXES:
        raise CLIError(f"--config {path}: expected a .yaml, .yml, .toml or .json file.")
    text = _config_text(path)
    try:
        if suffix in (".yaml", ".yml"):
            data = _yaml_without_aliases(text)
        elif suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except CLIError as error:
        raise CLIError(f"--config {path}: {error}") from None
    except ImportError:
        raise CLIError(f"--config {path}: TOML needs Python 3.11 or the tomli package.") from None
    except RecursionError:
        raise CLIError(f"--config {path}: nested too deeply to read.") from None
    except Exception as error:  # the parsers' own errors (yaml.YAMLError, TOMLDecodeError, JSONDecodeError)
        raise CLIError(f"--config {path}: not valid {suffix[1:].upper()} ({error}).") from None
    if not isinstance(data, dict):
        raise CLIError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}.")
    _check_config_values(data, path, "")
    return data


def _config_text(path: str) -> str:
    """The text of `path`, opened once and checked as opened: a regular file (a FIFO or a device such as /dev/zero
    is refused before a byte is read, without waiting on it), at most MAX_CONFIG_BYTES, UTF-8."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise CLIError(f"--config {path}: cannot read the file ({error.strerror or error}).") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CLIError(f"--config {path}: not a regular file; give the path of a .yaml, .toml or .json file.")
        data = b""
        while len(data) <= MAX_CONFIG_BYTES:
            piece = os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))
            if not piece:
                break
            data += piece
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise CLIError(f"--config {path}: larger than {MAX_CONFIG_BYTES // 1024} KiB; a file of flags is far smaller.")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise CLIError(f"--config {path}: not UTF-8 (byte {error.start} is {data[error.start]:#04x}).") from None


def _yaml_without_aliases(text: str):
    """safe_load without aliases: a few hundred bytes of nested aliases expand to tens of millions of items."""
    import yaml  # PyYAML, which huggingface_hub depends on

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise CLIError(f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not accepted.")
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=NoAliases)  # noqa: S506 - SafeLoader's constructors; only composing differs


def _check_config_values(value, path: str, where: str) -> None:
    """CLIError naming the file and key of a value JSON cannot hold (a YAML or TOML date, a set, bytes)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CLIError(f"--config {path}: the key {key!r}{where and ' under ' + where} is not a string.")
            _check_config_values(item, path, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_config_values(item, path, f"{where}[{i}]")
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise CLIError(
            f"--config {path}: {where} is a {type(value).__name__} ({value!r}); expected a string, number, boolean, "
            "list or mapping (quote a date to pass it as text)."
        )


def with_config(parser: argparse.ArgumentParser, argv: list[str], command: str, path: str) -> list[str]:
    """`argv` with the flags of the --config file inserted right after the subcommand, so that the command line's own
    flags, which come later, win; every name and value is then checked by argparse as if typed."""
    import json

    from ..core.config import closest

    sub = parser.commands[command]
    options = {o: a for a in sub._actions for o in a.option_strings if o.startswith("--")}
    tokens = []
    for name, value in read_config(path).items():
        flag = "--" + str(name).replace("_", "-")
        action = options.get(flag)
        if action is None or flag in ("--config", "--help"):
            close = closest(flag, set(options) - {"--config", "--help"})
            raise CLIError(
                f"--config {path}: {name!r} is not a flag of decodekit {command}"
                + (f" (did you mean {close[2:]!r}?)" if close else "")
                + "."
            )
        if action.nargs == 0:  # a switch: store_true, or --x/--no-x
            if not isinstance(value, bool):
                raise CLIError(f"--config {path}: {name} is a switch; expected true or false, got {value!r}.")
            if isinstance(action, argparse.BooleanOptionalAction):
                tokens.append(flag if value else "--no-" + flag[2:])
            elif value:
                tokens.append(flag)
        elif flag == "--arg" and isinstance(value, dict):
            tokens += [t for key, v in value.items() for t in (flag, f"{key}={json.dumps(v)}")]
        elif isinstance(value, list):
            if not isinstance(action, argparse._AppendAction):
                raise CLIError(f"--config {path}: {name} takes one value, got a list.")
            tokens += [t for item in value for t in (flag, item if isinstance(item, str) else json.dumps(item))]
        else:
            tokens += [flag, value if isinstance(value, str) else json.dumps(value)]
    at = argv.index(command) + 1
    return [*argv[:at], *tokens, *argv[at:]]
