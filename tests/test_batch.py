"""`decodekit batch` and decodekit.batch_job: every row equals generate() on its prompt alone, with built-in fields,
a hook-only method and a full-loop method; an interrupted run goes on where it stopped and loses nothing; bad
input names the file and line."""

import json

import pytest

from decodekit.batch_job import OUTPUT_KEYS, BatchSettings, RowGenerator, run_batch
from decodekit.cli import main

from methods import HOOK_METHOD, TRANSFORMERS_STYLE_GREEDY, write_method
from helpers import PATIENCE

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "The best way to learn is"]


def write_input(path, prompts=PROMPTS):
    rows = [{"prompt": p, **({"id": f"row-{i}"} if i % 2 else {})} for i, p in enumerate(prompts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def direct(model, tok, prompt, **kwargs):
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    return model.generate(ids, tokenizer=tok, **kwargs)[0, ids.shape[1] :].tolist()


def read_output(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_row_equals_generate_alone_and_a_stopped_run_resumes(default_model, tmp_path, capsys):
    model, tok = default_model
    rows = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(tmp_path / "in.jsonl"), str(out), "--max-new-tokens", "6", "--no-progress"]) == 0
    assert "4 rows generated, 0 already in" in capsys.readouterr().err
    results = read_output(out)
    assert [r["id"] for r in results] == [1, "row-1", 3, "row-3"]  # the line number where a row has no id
    for row, result in zip(rows, results):
        assert result["prompt"] == row["prompt"]
        assert result["generated_token_ids"] == direct(model, tok, row["prompt"], max_new_tokens=6)
        assert result["generated_text"] == tok.decode(result["generated_token_ids"], skip_special_tokens=True)
    # Stopped after two rows, the third cut off mid-write: the two stay as they were, the rest is generated.
    kept = "".join(json.dumps(r) + "\n" for r in results[:2])
    out.write_text(kept + json.dumps(results[2])[:25])
    assert main(["batch", str(tmp_path / "in.jsonl"), str(out), "--max-new-tokens", "6", "--no-progress"]) == 0
    assert "2 rows generated, 2 already in" in capsys.readouterr().err
    assert out.read_text().startswith(kept) and read_output(out) == results


@pytest.mark.parametrize(
    "method, extra",
    [(HOOK_METHOD, {"banned_token": 7042}), (TRANSFORMERS_STYLE_GREEDY, {})],
    ids=["hook-only", "full-loop"],
)
def test_a_method_runs_for_every_row(default_model, tmp_path, method, extra):
    model, tok = default_model
    repo = write_method(tmp_path / "method", method)
    write_input(tmp_path / "in.jsonl", PROMPTS[:2])
    settings = BatchSettings(method=str(repo), trust_remote_code=True, generation={"max_new_tokens": 5, **extra})
    assert run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", settings, progress=False) == (2, 0)
    for prompt, result in zip(PROMPTS, read_output(tmp_path / "out.jsonl")):
        expected = direct(
            model, tok, prompt, custom_generate=str(repo), trust_remote_code=True, max_new_tokens=5, **extra
        )
        assert result["generated_token_ids"] == expected
    if extra:  # the hook-only method banned " Paris", which the first prompt continues with otherwise
        assert 7042 not in read_output(tmp_path / "out.jsonl")[0]["generated_token_ids"]


def test_a_row_generator_takes_the_chat_template(default_model):
    model, tok = default_model
    generator = RowGenerator.around(BatchSettings(chat=True, generation={"max_new_tokens": 4}), model, tok)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt")
    expected = model.generate(ids, max_new_tokens=4)[0, ids.shape[1] :].tolist()
    assert generator("Hi")["generated_token_ids"] == expected
    assert generator.many(["Hi", "Hi"]) == [generator("Hi")] * 2 and generator.batched


@pytest.mark.parametrize(
    "method, fields, batched",
    [
        (None, {"do_sample": True, "seed": 5, "top_k": 20}, True),
        (HOOK_METHOD, {"banned_token": 7042}, True),
        (None, {"num_beams": 2}, False),  # beam search owns its rows: one prompt at a time
        (TRANSFORMERS_STYLE_GREEDY, {}, False),
    ],
    ids=["seeded-sampling", "hook-only", "beam-search", "full-loop"],
)
def test_rows_share_steps_where_the_method_allows_and_equal_generate_alone(
    default_model, tmp_path, method, fields, batched
):
    model, tok = default_model
    repo = write_method(tmp_path / "method", method) if method else None
    generation = {"max_new_tokens": 6, **fields}
    settings = BatchSettings(method=str(repo) if repo else None, trust_remote_code=True, generation=generation)
    generator = RowGenerator.around(settings, model, tok)
    rows = generator.many(PROMPTS)
    assert generator.batched is batched
    method_args = {"custom_generate": str(repo), "trust_remote_code": True} if repo else {}
    for prompt, row in zip(PROMPTS, rows):
        assert row["generated_token_ids"] == direct(model, tok, prompt, **method_args, **generation), prompt


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a"}', "not json"], "in.jsonl:2: not JSON"),
        (['{"text": "a"}'], "in.jsonl:1: expected a JSON object with a string under 'prompt'"),
        (['{"prompt": "a", "id": 5}', '{"prompt": "b", "id": 5}'], "in.jsonl:2: id 5 appears twice"),
        (
            ['{"prompt": "a"}', '{"prompt": "b", "error": "none"}'],
            "in.jsonl:2: the row has ['error'], which the output writes to each row",
        ),
        (['{"prompt": "a", "generated_text": "x"}'], "in.jsonl:1: the row has ['generated_text']"),
    ],
    ids=["not-json", "no-prompt", "duplicate-id", "error-column", "output-column"],
)
def test_bad_input_names_the_file_and_line(tmp_path, capsys, lines, message):
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--no-progress"]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out.jsonl").exists()


def test_the_input_file_as_output_is_refused_and_left_as_it_was(tmp_path, capsys):
    # Before: the rows were appended to the input file itself.
    source = tmp_path / "in.jsonl"
    write_input(source, PROMPTS[:2])
    before = source.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(source)
    for output in (source, tmp_path / "link.jsonl", tmp_path / "." / "in.jsonl"):
        assert main(["batch", str(source), str(output), "--no-progress"]) == 2
        assert "is the input file" in capsys.readouterr().err and source.read_bytes() == before


def test_duplicate_prompts_without_ids_are_each_a_row(default_model, tmp_path):
    model, tok = default_model
    (tmp_path / "in.jsonl").write_text('{"prompt": "Hello there"}\n' * 3)
    assert run_batch(
        tmp_path / "in.jsonl", tmp_path / "out.jsonl", BatchSettings(generation={"max_new_tokens": 4}), progress=False
    ) == (3, 0)
    results = read_output(tmp_path / "out.jsonl")
    assert sorted(r["id"] for r in results) == [1, 2, 3]
    assert all(r["generated_token_ids"] == direct(model, tok, "Hello there", max_new_tokens=4) for r in results)


def test_an_untrusted_method_is_refused_before_any_row(default_model, tmp_path, capsys):
    repo = write_method(tmp_path / "method", HOOK_METHOD)
    write_input(tmp_path / "in.jsonl", PROMPTS[:1])
    assert (
        main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--method", str(repo), "--no-progress"])
        == 2
    )
    err = capsys.readouterr().err
    assert "was not run: it is code from outside decodekit" in err and "pass --trust-remote-code" in err
    assert not (tmp_path / "out.jsonl").exists() or (tmp_path / "out.jsonl").read_text() == ""  # no row


# ---- the second hardening pass: rows fail alone, are written as they end, and a run is one at a time ----


@pytest.mark.parametrize(
    "generation", [{"max_new_tokens": 4}, {"max_new_tokens": 4, "num_beams": 2}], ids=["batched", "one-at-a-time"]
)
def test_a_bad_row_fails_alone_names_itself_and_a_resume_goes_on(default_model, tmp_path, capsys, generation):
    model, tok = default_model
    lines = [
        json.dumps({"prompt": PROMPTS[0]}),
        json.dumps({"prompt": "", "id": "empty"}),
        '{"prompt": "\\ud800 broken", "id": "surrogate"}',
        json.dumps({"prompt": PROMPTS[1]}),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["batch", str(tmp_path / "in.jsonl"), str(out), "--no-progress", "--max-new-tokens", "4"]
    argv += ["--arg", "num_beams=2"] if "num_beams" in generation else []
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert '2 rows generated, 2 failed (ids "empty", "surrogate"' in err
    results = {r["id"]: r for r in read_output(out)}
    assert "the prompt is empty" in results["empty"]["error"] and "lone surrogate" in results["surrogate"]["error"]
    assert results[1]["generated_token_ids"] == direct(model, tok, PROMPTS[0], **generation)
    assert results[4]["generated_token_ids"] == direct(model, tok, PROMPTS[1], **generation)
    assert main(argv) == 0 and "0 rows generated, 4 already in" in capsys.readouterr().err  # failed rows are not redone


def test_rows_of_a_one_at_a_time_method_are_on_disk_as_each_ends(default_model, tmp_path, monkeypatch):
    write_input(tmp_path / "in.jsonl", PROMPTS[:3])
    out = tmp_path / "out.jsonl"
    seen = []
    call = RowGenerator.__call__

    def watching(self, prompt):
        seen.append(len(out.read_text().splitlines()) if out.exists() else 0)  # rows on disk when this one starts
        return call(self, prompt)

    monkeypatch.setattr(RowGenerator, "__call__", watching)
    run_batch(
        tmp_path / "in.jsonl", out, BatchSettings(generation={"max_new_tokens": 3, "num_beams": 2}), progress=False
    )
    assert seen == [0, 1, 2]  # before: nothing until the 32-row group was done


def test_a_second_run_on_the_same_output_refuses_while_the_first_writes(tmp_path, capsys):
    import fcntl

    write_input(tmp_path / "in.jsonl", PROMPTS[:1])
    out = tmp_path / "out.jsonl"
    with open(out, "a") as first:
        fcntl.flock(first.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # a first run holds it
        assert main(["batch", str(tmp_path / "in.jsonl"), str(out), "--no-progress"]) == 2
    assert f"another decodekit batch is writing {out}" in capsys.readouterr().err and out.read_text() == ""


def test_ctrl_c_stops_with_one_message_and_exit_130(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    write_input(
        tmp_path / "in.jsonl", [f"Story number {i}:" for i in range(400)]
    )  # chunks left when the first row lands
    out = tmp_path / "out.jsonl"
    # SIGINT as a terminal delivers it: a suite started in the background (`cmd &`) passes SIGINT ignored to its
    # children, and Python then raises no KeyboardInterrupt at all.
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "decodekit.cli",
            "batch",
            str(tmp_path / "in.jsonl"),
            str(out),
            "--no-progress",
            "--max-new-tokens",
            "8",
            "--arg",
            "num_beams=2",
        ],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + PATIENCE
    while not (out.exists() and out.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    run.send_signal(signal.SIGINT)
    err = run.communicate(timeout=PATIENCE)[1]
    assert run.returncode == 130 and "Traceback" not in err and len(err.strip().splitlines()) <= 2
    assert "the same command goes on from there" in err
    assert all("generated_token_ids" in row for row in read_output(out))  # every line whole


FACTS = [f"Fact number {i}:" for i in range(8)]


def batch_arguments(source, out) -> list[str]:
    """`decodekit batch` of `source` into `out`, one prompt at a time (beam search: rows land as it runs)."""
    return ["batch", str(source), str(out), "--no-progress", "--max-new-tokens", "4", "--arg", "num_beams=2"]


def batch_command(source, out, interrupt_at: int):
    """batch_arguments run in a child that takes SIGINT as a terminal delivers it, interrupted once `out` holds
    `interrupt_at` rows (0: half a second after the start, while the model loads): counted in rows rather than seconds
    so that a busy machine interrupts at the same point. (exit code, stderr)."""
    import signal
    import subprocess
    import sys
    import time

    argv = [sys.executable, "-m", "decodekit.cli", *batch_arguments(source, out)]
    process = subprocess.Popen(
        argv, stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    deadline = time.monotonic() + PATIENCE
    if interrupt_at == 0:
        time.sleep(0.5)
    while process.poll() is None and time.monotonic() < deadline:
        if interrupt_at == 0 or (out.exists() and out.read_text().count("\n") >= interrupt_at):
            process.send_signal(signal.SIGINT)
            break
        time.sleep(0.02)
    err = process.communicate(timeout=PATIENCE)[1]
    return process.returncode, err


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The batch of FACTS run once without interruption: the output every interrupted run must end with."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    write_input(folder / "in.jsonl", FACTS)
    assert main(batch_arguments(folder / "in.jsonl", folder / "whole.jsonl")) == 0
    return read_output(folder / "whole.jsonl")


@pytest.mark.parametrize("rows", [0, 1, 4], ids=["while-loading", "early", "later"])
def test_ctrl_c_at_any_point_then_the_same_command_gives_the_uninterrupted_output(tmp_path, rows, uninterrupted):
    import signal

    write_input(tmp_path / "in.jsonl", FACTS)
    out = tmp_path / "out.jsonl"
    code, err = batch_command(tmp_path / "in.jsonl", out, interrupt_at=rows)
    if code == -signal.SIGINT:  # it came before Python had its own handler (a busy machine's first 0.5 s): the
        assert not out.exists() or out.read_text() == ""  # process ended as any program does, nothing written yet
    elif code != 0:  # stopped: one message, no traceback, every line on disk whole
        assert code == 130 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        if out.exists():
            assert all("generated_token_ids" in row for row in read_output(out))
    if rows:
        assert code == 130 and len(read_output(out)) < len(FACTS)  # stopped part way: the resume has work to do
    assert main(batch_arguments(tmp_path / "in.jsonl", out)) == 0  # the same command, run in this process
    by_id = lambda rows: sorted(rows, key=lambda row: json.dumps(row["id"]))  # noqa: E731
    assert by_id(read_output(out)) == by_id(uninterrupted)


@pytest.mark.parametrize(
    "content, words",
    [
        (b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', "in.jsonl:2: not UTF-8 (byte 16 of the line is 0xe9)"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "in.jsonl:1: not JSON (nested too deeply to read)"),
    ],
    ids=["invalid-utf8", "deep-json"],
)
def test_unreadable_input_lines_name_the_file_and_line(tmp_path, capsys, content, words):
    (tmp_path / "in.jsonl").write_bytes(content)
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--no-progress"]) == 2
    assert words in capsys.readouterr().err


def test_a_byte_order_mark_is_read_and_a_bad_byte_in_the_output_does_not_stop_a_resume(default_model, tmp_path, capsys):
    (tmp_path / "in.jsonl").write_bytes(
        b"\xef\xbb\xbf" + "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]).encode()
    )
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": 9, "note": "\xff"}\n')  # a line of someone else's, not UTF-8: kept, not counted
    assert main(["batch", str(tmp_path / "in.jsonl"), str(out), "--no-progress", "--max-new-tokens", "3"]) == 0
    assert "2 rows generated, 0 already in" in capsys.readouterr().err
    assert out.read_bytes().startswith(b'{"id": 9, "note": "\xff"}\n')


def test_a_runner_generates_the_pending_rows_elsewhere_and_run_batch_writes_them(tmp_path):
    # What decodekit.integrations.ray.on_ray(address) plugs in: rows in, rows with results out, in any order.
    write_input(tmp_path / "in.jsonl", ["a", "b", "c"])
    handed = []

    def runner(rows, settings):
        handed.append([row["prompt"] for row in rows])
        for row in reversed(rows):
            result = {key: row["prompt"].upper() for key in OUTPUT_KEYS} if row["prompt"] != "b" else {"error": "bad"}
            yield {**row, **result}

    out = tmp_path / "out.jsonl"
    counts = run_batch(tmp_path / "in.jsonl", out, BatchSettings(), progress=False, runner=runner)
    assert (counts.written, counts.skipped, len(counts.failed)) == (2, 0, 1)
    assert handed == [["a", "b", "c"]]
    assert sorted(json.loads(line).get(OUTPUT_KEYS[0], "-") for line in out.read_text().splitlines()) == ["-", "A", "C"]
    again = run_batch(tmp_path / "in.jsonl", out, BatchSettings(), progress=False, runner=runner)
    assert tuple(again) == (0, 3) and handed[-1] == ["a", "b", "c"]  # nothing pending: the runner is not called


@pytest.mark.parametrize("at", [0.1, 0.4, 0.7])
def test_ctrl_c_while_rows_share_steps_writes_no_unfinished_row_and_a_resume_completes_them(
    default_model, tmp_path, monkeypatch, at
):
    # Under continuous batching Ctrl-C ends the running requests CANCELLED: they were written as finished rows
    # (their text so far, often "" and []), so the resumed run skipped them and 32 of 32 rows differed.
    from decodekit.batching import ContinuousBatchingManager

    model, tok = default_model
    prompts = [f"Fact number {i}:" for i in range(6)]
    settings = BatchSettings(generation={"max_new_tokens": 8})
    step = ContinuousBatchingManager._loop_once
    count = {"steps": 0, "stop": None}

    def counted(self):
        count["steps"] += 1
        if count["stop"] is not None and count["steps"] > count["stop"]:
            raise KeyboardInterrupt  # where a Ctrl-C lands: between two steps
        return step(self)

    monkeypatch.setattr(ContinuousBatchingManager, "_loop_once", counted)
    generator = RowGenerator.around(settings, model, tok)
    assert generator._can_batch()
    count["steps"] = 0
    whole = generator.many(prompts)
    count["stop"], count["steps"] = int(at * count["steps"]), 0
    written = {}
    with pytest.raises(KeyboardInterrupt):
        generator.many(prompts, on_row=written.__setitem__)
    assert len(written) < len(prompts)  # stopped with rows unfinished
    assert all(written[i] == whole[i] for i in written)  # what was written is finished
    count["stop"] = None
    rest = [i for i in range(len(prompts)) if i not in written]
    assert generator.many([prompts[i] for i in rest]) == [whole[i] for i in rest]
