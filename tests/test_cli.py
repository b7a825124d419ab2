"""The command line as a user meets it: --version, errors before any model loads, on their own line and with one
prefix, flags named in messages, strategy flags, --stats, and `decodekit list` within the terminal's width."""

import os

import pytest

import decodekit
from decodekit.cli import main
from helpers import PATIENCE


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model or tokenizer load fails the test: the errors below must come before one."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the command line was checked")

    monkeypatch.setattr(decodekit.loading.AutoModelForCausalLM, "from_pretrained", staticmethod(refuse))
    monkeypatch.setattr(decodekit.loading.AutoTokenizer, "from_pretrained", staticmethod(refuse))


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"decodekit {decodekit.__version__}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["Hi", "--do-sample", "--top-p", "2.0"],
            "generation config: --top-p 2.0 is invalid; expected a number in (0, 1].",
        ),
        (["Hi", "--top-k", "5"], "--top-k only apply when sampling; add --do-sample."),
        (["Hi", "--arg", "num_beam=2"], "did you mean --num-beams?"),
        (["Hi", "--arg", "repetiton_penalty=1.2"], "did you mean --arg repetition_penalty=...?"),
        (["Hi", "--arg", "repetition_penalty=-1"], "repetition_penalty=-1 is invalid"),
        (["   "], "the prompt is empty; give the text to continue"),
        (["Hi", "--arg", "nokey"], "--arg 'nokey' is invalid; expected KEY=VALUE"),
        (["Hi", "--do-sample", "--samplers", "foo"], "--samplers 'foo' is invalid; 'f' is not a sampler"),
        (["Hi", "--do-sample", "--mirostat", "3"], "--mirostat 3 is invalid; expected 0 (off), 1 (mirostat) or 2"),
        (["Hi", "--arg", "xtc_probability=2"], "--xtc-probability 2 is invalid"),
    ],
    ids=[
        "bad-top-p",
        "sampling-flag",
        "misspelt-flag-field",
        "misspelt-field",
        "bad-arg-value",
        "empty",
        "no-equals",
        "sampler-name",
        "mirostat-version",
        "plugin-field-value",
    ],
)
def test_bad_arguments_are_reported_before_any_model_loads(no_model_loads, capsys, argv, message):
    assert main(["generate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing echoed
    assert captured.err.startswith("decodekit: error: ") and captured.err.count("decodekit:") == 1
    assert message in captured.err


def test_an_error_during_generation_goes_on_its_own_line(default_model, capsys):
    # What only the model can tell (its layer count) is checked when generate() runs, after the prompt was echoed.
    assert main(["generate", "Hi", "--arg", "assistant_early_exit=500"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "Hi\n"
    assert captured.err.startswith("decodekit: error: generation config: assistant_early_exit=500 is invalid")


def test_a_value_its_plugin_refuses_is_reported_before_the_model_loads(no_model_loads, capsys):
    assert main(["generate", "Hi", "--penalty-alpha", "0.5", "--top-k", "1"]) == 2
    assert capsys.readouterr().err.startswith("decodekit: error: generation config: --penalty-alpha 0.5 needs")


def test_strategy_flags_and_stats(default_model, capsys):
    assert main(["generate", "The capital of France is", "--num-beams", "2", "--max-new-tokens", "4", "--stats"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("The capital of France is Paris")
    assert (
        "beam search cannot stream" in captured.err and "stats: load" in captured.err and "4 tokens in" in captured.err
    )
    assert (
        main(["generate", "The capital of France is", "--prompt-lookup", "2", "--max-new-tokens", "4", "--stats"]) == 0
    )
    captured = capsys.readouterr()
    assert captured.out.startswith("The capital of France is Paris") and "first token after" in captured.err


def test_list_fits_80_columns_and_verbose_does_not(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80 and any(line.startswith("greedy (built-in)") for line in lines)
    assert main(["list", "--verbose"]) == 0
    wide = capsys.readouterr().out.splitlines()
    assert wide[0].split() == ["NAME", "KIND", "SOURCE", "HOOKS", "KWARGS", "DESCRIPTION"] and max(map(len, wide)) > 80


def test_the_spinner_turns_then_clears_its_line():
    import io
    import time

    from decodekit.cli.terminal import Spinner

    out = io.StringIO()
    spinner = Spinner("compiling", stream=out, interval=0.01).start()
    time.sleep(0.1)
    spinner.stop()
    spinner.stop()  # twice is harmless
    text = out.getvalue()
    assert text.count("\rcompiling ") >= 3 and text.endswith("\r" + " " * len("compiling  ") + "\r")


def test_stats_holds_tokens_back_until_the_step_after_the_first():
    import torch

    from decodekit.cli.terminal import Stats

    seen, events = [], []

    class Inner:
        def put(self, value):
            seen.append(value.tolist())

        def end(self):
            events.append("end")

    stats = Stats(Inner(), on_first=lambda: events.append(("first", len(seen))), hold=1)
    stats.put(torch.tensor([[1, 2]]))  # the prompt goes through at once
    stats.put(torch.tensor([3]))
    assert seen == [[[1, 2]]] and events == []
    stats.put(torch.tensor([4]))
    stats.put(torch.tensor([5]))
    stats.end()
    assert seen == [[[1, 2]], [3], [4], [5]] and events == [("first", 1), "end"] and stats.tokens == 3


def test_a_methods_own_arg_fields_are_checked_before_the_model_loads(no_model_loads, tmp_path, capsys):
    from methods import HOOK_METHOD, write_method

    method = write_method(tmp_path / "ban", HOOK_METHOD)
    argv = ["generate", "Hi", "--custom-generate", str(method), "--trust-remote-code", "--arg", "banned_tokn=5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "--arg banned_tokn=... is taken neither by the method" in err and "did you mean --arg banned_token=...?" in err
    )


CHECKED_METHOD = """
from decodekit import hookimpl


@hookimpl
def decodekit_config_fields():
    return {"my_method_penalty": 1.0}


@hookimpl
def decodekit_validate_config(generation_config, context):
    if generation_config.my_method_penalty < 0:
        raise generation_config.invalid("my_method_penalty", "expected a number >= 0")
    if context.model.config.vocab_size < 10:  # a check that needs the model waits for the call
        raise ValueError("too small a model")
"""


def test_a_methods_own_validation_runs_before_the_model_loads(no_model_loads, tmp_path, capsys):
    from methods import write_method

    method = write_method(tmp_path / "checked", CHECKED_METHOD)
    argv = ["generate", "Hi", "--custom-generate", str(method), "--trust-remote-code", "--arg", "my_method_penalty=-1"]
    assert main(argv) == 2
    assert "my_method_penalty=-1 is invalid; expected a number >= 0" in capsys.readouterr().err
    # A valid value passes the check (the model-dependent check waits): the load is what comes next.
    with pytest.raises(AssertionError, match="a model was loaded"):
        main([*argv[:-1], "my_method_penalty=0.5"])


def test_verbose_is_taken_after_the_subcommand_too():
    from decodekit.cli.parser import build_parser

    assert build_parser().parse_args(["generate", "-v", "Hi"]).verbose is True
    assert build_parser().parse_args(["-v", "generate", "Hi"]).verbose is True
    assert build_parser().parse_args(["generate", "Hi"]).verbose is False


def test_a_non_number_for_a_count_flag_names_what_is_expected(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "Hi", "--max-new-tokens", "abc"])
    assert "argument --max-new-tokens: expected an integer >= 1, got 'abc'" in capsys.readouterr().err


def test_serve_paged_attention_takes_its_choices_and_needs_the_compiled_step(no_model_loads, capsys):
    from decodekit.batching.compiled import ATTENTION
    from decodekit.cli.parser import build_parser

    serve = build_parser().commands["serve"]
    flag = next(a for a in serve._actions if "--paged-attention" in a.option_strings)
    assert tuple(flag.choices) == ATTENTION  # one vocabulary: the manager's and the command line's
    with pytest.raises(SystemExit):
        main(["serve", "--paged-attention", "paged"])
    assert "argument --paged-attention: invalid choice: 'paged'" in (capsys.readouterr().err)
    assert main(["serve", "--port", "0", "--paged-attention", "flex", "--no-compile"]) == 2
    assert "--paged-attention flex chooses the compiled decode step's attention; drop --no-compile" in (
        capsys.readouterr().err
    )
    # On the CPU, flex with inductor is refused: before the model loads, not after.
    assert main(["serve", "--port", "0", "--paged-attention", "flex"]) == 2
    assert "--paged-attention flex is for compiled steps on a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "Hi"], ["serve"], ["batch", "in.jsonl", "out.jsonl"]])
def test_device_names_a_device_this_torch_has(no_model_loads, command, capsys):
    """--device takes any torch device the process has; one it lacks, or no device at all, is refused before any
    model loads, with what is there."""
    import torch

    from decodekit.cli.parser import build_parser

    assert build_parser().parse_args([*command, "--device", "cpu"]).device == "cpu"
    assert build_parser().parse_args(command).device == "cpu"
    for bad, says in (
        ("cuda:99", "'cuda:99': this torch (" + torch.__version__ + ") has"),
        ("gpu", "'gpu' is not a torch device"),
    ):
        if bad == "cuda:99" or not torch.cuda.is_available():
            with pytest.raises(SystemExit):
                main([*command, "--device", bad])
            assert f"argument --device: {says}" in capsys.readouterr().err


def test_generate_and_batch_load_the_model_on_the_device_given(default_model, monkeypatch, capsys):
    """The flag reaches from_pretrained for the model, an assistant and batch's rows."""
    from decodekit.batch_job import BatchSettings, RowGenerator
    from decodekit.loading.default import default_model_path

    seen = []
    load = decodekit.loading.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        seen.append(kwargs.get("device"))
        return load(*args, **kwargs)

    monkeypatch.setattr(decodekit.loading.AutoModelForCausalLM, "from_pretrained", staticmethod(recording))
    path = str(default_model_path())
    assert main(["generate", "Hi", "--assistant", path, "--device", "cpu", "--max-new-tokens", "2", "--no-stream"]) == 0
    assert seen == ["cpu", "cpu"]
    assert RowGenerator(BatchSettings(device="cpu", generation={"max_new_tokens": 2}))("Hi")["generated_token_ids"]
    assert seen == ["cpu", "cpu", "cpu"]
    capsys.readouterr()


def test_check_names_a_misspelt_hook_and_prints_the_pin_to_trust(tmp_path, capsys):
    from decodekit.hub_loader.source import resolve

    from methods import HOOK_METHOD, write_method

    misspelt = write_method(
        tmp_path / "misspelt", HOOK_METHOD.replace("decodekit_logits_processors", "decodekit_logit_processors")
    )
    assert main(["check", str(misspelt)]) == 1
    assert (
        "custom_generate/generate.py:12: decodekit_logit_processors is not a decodekit hook (did you mean "
        "decodekit_logits_processors?)"
    ) in capsys.readouterr().out
    good = write_method(tmp_path / "good", HOOK_METHOD)
    assert main(["check", str(good)]) == 0
    assert f"pin: {good}@{resolve(str(good)).revision}" in capsys.readouterr().out


def test_config_files_give_flags_and_the_command_line_wins(tmp_path):
    from decodekit.cli.config_file import with_config
    from decodekit.cli.parser import build_parser

    (tmp_path / "chat.yaml").write_text(
        "max_new_tokens: 5\ndo_sample: true\ntemperature: 0.7\narg: {repetition_penalty: 1.2}\nsystem: Be brief.\n"
    )
    (tmp_path / "serve.toml").write_text('port = 9001\ncompile = false\nmethod = ["./a@1", "./b@2"]\nmax_running = 8\n')
    parser = build_parser()
    argv = ["chat", "--config", str(tmp_path / "chat.yaml"), "--temperature", "0.9"]
    args = parser.parse_args(with_config(parser, argv, "chat", str(tmp_path / "chat.yaml")))
    assert (args.max_new_tokens, args.do_sample, args.temperature, args.system) == (5, True, 0.9, "Be brief.")
    assert args.arg == ["repetition_penalty=1.2"]
    argv = ["serve", "--config", str(tmp_path / "serve.toml"), "--max-running", "16"]
    args = parser.parse_args(with_config(parser, argv, "serve", str(tmp_path / "serve.toml")))
    assert (args.port, args.compile, args.method, args.max_running) == (9001, False, ["./a@1", "./b@2"], 16)


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_new_token: 5\n", "'max_new_token' is not a flag of decodekit batch (did you mean 'max-new-tokens'?)"),
        ("chat: 3\n", "chat is a switch; expected true or false, got 3"),
        ("- 1\n- 2\n", "expected a mapping of flag names to values, got list"),
        ("max_new_tokens: [1, 2]\n", "max_new_tokens takes one value, got a list"),
        ("a: b: c\n", "not valid YAML"),
        # A few hundred bytes of nested aliases expand to tens of millions of items: refused, not expanded.
        (
            "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b]\n",
            "line 2: YAML aliases (*a) are not accepted",
        ),
        ("seed: 2024-01-01\n", "seed is a date (datetime.date(2024, 1, 1)); expected a string, number, boolean"),
        ("arg: {when: !!binary aGk=}\n", "arg.when is a bytes"),
        ("stop: !!set {a, b}\n", "stop is a set"),
    ],
)
def test_a_bad_config_file_is_named_before_any_model_loads(no_model_loads, tmp_path, capsys, text, message):
    (tmp_path / "cfg.yaml").write_text(text)
    assert main(["batch", "in.jsonl", "out.jsonl", "--config", str(tmp_path / "cfg.yaml")]) == 2
    assert message in capsys.readouterr().err


def test_a_config_path_that_is_no_regular_file_is_refused_without_reading_it(no_model_loads, tmp_path, capsys):
    # /dev/zero was read whole before its suffix was looked at (MemoryError at 5.5 GB); a FIFO named .yaml hung.
    assert main(["batch", "in.jsonl", "out.jsonl", "--config", "/dev/zero"]) == 2
    assert "expected a .yaml, .yml, .toml or .json file" in capsys.readouterr().err
    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    assert main(["batch", "in.jsonl", "out.jsonl", "--config", str(fifo)]) == 2  # returns: nothing waits on it
    assert "not a regular file" in capsys.readouterr().err
    (tmp_path / "dir.yaml").mkdir()
    assert main(["batch", "in.jsonl", "out.jsonl", "--config", str(tmp_path / "dir.yaml")]) == 2
    assert "not a regular file" in capsys.readouterr().err
    big = tmp_path / "big.json"
    big.write_text('{"seed": 1, "pad": "' + "x" * (1 << 20) + '"}')
    assert main(["batch", "in.jsonl", "out.jsonl", "--config", str(big)]) == 2
    assert "larger than 1024 KiB" in capsys.readouterr().err
    toml = tmp_path / "cfg.toml"
    toml.write_text("seed = 1979-05-27\n")
    assert main(["batch", "in.jsonl", "out.jsonl", "--config", str(toml)]) == 2
    assert f"--config {toml}: seed is a date" in capsys.readouterr().err


def test_a_config_value_of_the_wrong_type_is_refused_by_its_flag(no_model_loads, tmp_path, capsys):
    (tmp_path / "cfg.json").write_text('{"max_new_tokens": "many"}')
    with pytest.raises(SystemExit) as exit_:
        main(["batch", "in.jsonl", "out.jsonl", "--config", str(tmp_path / "cfg.json")])
    assert (
        exit_.value.code == 2
        and "argument --max-new-tokens: expected an integer >= 1, got 'many'" in capsys.readouterr().err
    )


def test_the_shell_completes_commands_flags_and_choices(tmp_path):
    """What bash asks through `eval "$(decodekit completion bash)"`: argcomplete's protocol, answered by the CLI."""
    import os
    import subprocess
    import sys

    def complete(line: str) -> list[str]:
        out = tmp_path / "completions"
        env = {
            **os.environ,
            "_ARGCOMPLETE": "1",
            "_ARGCOMPLETE_IFS": "\013",
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
            "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
        }
        done = subprocess.run(
            [sys.executable, "-m", "decodekit.cli"], env=env, capture_output=True, text=True, timeout=PATIENCE
        )
        assert done.returncode == 0, done.stderr
        return [word.strip() for word in out.read_text().split("\013")]

    assert set(complete("decodekit c")) == {"chat", "check", "completion"}
    assert complete("decodekit serve --comp") == ["--compile"]
    assert set(complete("decodekit generate Hi --dtype ")) == {"float32", "bfloat16", "float16"}
    assert "--system" in complete("decodekit chat --s")
    shell = subprocess.run(
        [sys.executable, "-m", "decodekit.cli", "completion", "bash"], capture_output=True, text=True, timeout=PATIENCE
    )
    assert shell.returncode == 0 and "complete " in shell.stdout and "decodekit" in shell.stdout
