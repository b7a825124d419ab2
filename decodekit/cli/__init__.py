"""The `decodekit` command line: `main` parses (parser.py, config_file.py) and runs a command (commands.py,
serving.py).
"""

from __future__ import annotations

import logging
import os
import sys

from .arguments import CLIError, cli_names
from .commands import cmd_completion, cmd_new
from .discover import cmd_info, cmd_search
from .config_file import with_config
from .parser import build_parser
from .terminal import interrupt_deferred, stopped


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C anywhere, while torch or the model loads too, is one line and exit code 130: nothing heavy is imported
    # before this point (decodekit's names load on first use), and torch's import holds it until it is done.
    try:
        parser = build_parser()
        if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (decodekit completion): answer, exit
            import argcomplete

            argcomplete.autocomplete(parser)
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
        if getattr(args, "config", None):
            argv = with_config(parser, argv, args.command, args.config)
            args = parser.parse_args(argv)
        args.argv = argv  # as given, config files read: what a helper process of this command is started with
        if args.trace:
            os.environ["DECODEKIT_TRACE"] = "1"  # read when the plugin manager is made, after this
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
        if args.func not in (cmd_new, cmd_completion, cmd_search, cmd_info):  # the others load torch, tokenizers...
            with interrupt_deferred():
                from .. import loading  # noqa: F401
        return args.func(args)
    except KeyboardInterrupt:
        print("\ndecodekit: stopped (Ctrl-C)", file=sys.stderr)
        return stopped()
    except BrokenPipeError:  # the reader (head, less) went away: nothing more to say
        sys.stdout = open(os.devnull, "w")
        return 0
    except (ValueError, OSError, ImportError, TypeError, AttributeError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and type(e).__name__ != "DefaultModelMissing":
            raise
        print(f"decodekit: error: {e if isinstance(e, CLIError) else cli_names(str(e))}", file=sys.stderr)
        return 2
