"""decodekit methods inside transformers' own generate(): to_transformers() and the entry point of hook-only
methods, against decodekit's loop on the same model; custom_generate methods on wrapped models."""

import pytest
import torch

import decodekit
from decodekit.hub_loader import UntrustedCodeError

from methods import HOOK_METHOD, TRANSFORMERS_STYLE_GREEDY, write_method
from tiny_transformers import PAD, tiny_transformers_model, transformers

from decodekit.integrations.transformers import to_transformers, wrap  # noqa: E402  (after the importorskip)

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
NEW = 10


@pytest.fixture(scope="module")
def hf():
    return tiny_transformers_model("phi")


def in_transformers(hf, hooks, ids=PROMPT, **kwargs):
    return hf.generate(
        ids, do_sample=False, eos_token_id=None, pad_token_id=PAD, max_new_tokens=NEW, **hooks._asdict(), **kwargs
    )


def in_decodekit(hf, ids=PROMPT, **kwargs):
    return wrap(hf).generate(ids, eos_token_id=None, max_new_tokens=NEW, **kwargs)


class PromptAware:
    """A processor that depends on the call (the prompt length it was built for) and a stopping criterion."""

    builds = 0

    @decodekit.hookimpl
    def decodekit_config_fields(self):
        return {"ban_after_prompt": None}

    @decodekit.hookimpl
    def decodekit_validate_config(self, generation_config):
        value = generation_config.ban_after_prompt
        if value is not None and (not isinstance(value, int) or value < 0):
            raise generation_config.invalid("ban_after_prompt", "expected a token id or None")

    @decodekit.hookimpl
    def decodekit_logits_processors(self, generation_config, context):
        banned, prompt_length = generation_config.ban_after_prompt, context.prompt_length
        if banned is None:
            return []
        PromptAware.builds += 1

        def ban_once_two_tokens_in(input_ids, scores):
            if input_ids.shape[1] >= prompt_length + 2:
                scores[:, banned] = -float("inf")
            return scores

        return [ban_once_two_tokens_in]

    @decodekit.hookimpl
    def decodekit_stopping_criteria(self, generation_config):
        return [lambda input_ids, scores: input_ids[:, -1] == 3]


@pytest.fixture
def prompt_aware():
    PromptAware.builds = 0
    name = decodekit.register(PromptAware(), name="prompt-aware")
    yield
    decodekit.unregister(name)


def test_registered_plugins_run_inside_transformers_generate_as_in_decodekits_loop(hf, prompt_aware):
    plain = in_decodekit(hf)
    banned = int(plain[0, PROMPT.shape[1] + 3])
    hooks = to_transformers(hf, ban_after_prompt=banned)
    theirs = in_transformers(hf, hooks)
    assert torch.equal(theirs, in_decodekit(hf, ban_after_prompt=banned))
    assert banned not in theirs[0, PROMPT.shape[1] + 2 :].tolist() and not torch.equal(theirs, plain)
    # The same lists serve a second call with a longer prompt: the pipeline is built again for it.
    longer = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]])
    assert torch.equal(in_transformers(hf, hooks, longer), in_decodekit(hf, longer, ban_after_prompt=banned))
    assert PromptAware.builds == 4  # two calls each way


def test_left_padded_batches_and_beam_search_in_transformers(hf, prompt_aware):
    batch = torch.tensor([[PAD, PAD, 5, 6, 7], [PAD, 8, 9, 10, 11], [12, 13, 14, 15, 16]])
    mask = (batch != PAD).long()
    hooks = to_transformers(hf, ban_after_prompt=4)
    assert torch.equal(
        in_transformers(hf, hooks, batch, attention_mask=mask),
        in_decodekit(hf, batch, attention_mask=mask, ban_after_prompt=4),
    )
    beams = dict(num_beams=3, num_return_sequences=2)
    assert torch.equal(in_transformers(hf, hooks, **beams), in_decodekit(hf, ban_after_prompt=4, **beams))


def test_bad_values_fail_before_generation(hf, prompt_aware):
    with pytest.raises(ValueError, match="ban_after_prompt=-1 is invalid; expected a token id or None"):
        to_transformers(hf, ban_after_prompt=-1)
    with pytest.raises(ValueError, match=r"unknown fields \['ban_after_promt'\] \(did you mean 'ban_after_prompt'\?\)"):
        to_transformers(hf, ban_after_promt=1)
    with pytest.raises(ValueError, match=r"\['nope'\] are not registered"):
        to_transformers(hf, plugins=["nope"])


def test_hooks_transformers_cannot_take_are_refused_by_name(hf):
    class Picker:
        @decodekit.hookimpl
        def decodekit_token_selector(self):
            return lambda input_ids, scores: scores.argmin(dim=-1)

    decodekit.register(Picker(), name="picker")
    try:
        with pytest.raises(
            ValueError, match=r"plugin 'picker' implements decodekit_token_selector \(token selection\)"
        ):
            to_transformers(hf)
        assert to_transformers(hf, plugins=[]).logits_processor  # nothing chosen, nothing refused
    finally:
        decodekit.unregister("picker")


def test_a_hook_only_method_directory_goes_through_the_trust_gate(hf, tmp_path):
    repo = write_method(tmp_path / "ban", HOOK_METHOD)
    with pytest.raises(UntrustedCodeError):
        to_transformers(hf, method=str(repo), banned_token=4)
    hooks = to_transformers(hf, method=str(repo), trust_remote_code=True, banned_token=4)
    theirs = in_transformers(hf, hooks)
    assert 4 not in theirs[0].tolist()
    assert torch.equal(theirs, in_decodekit(hf, custom_generate=str(repo), trust_remote_code=True, banned_token=4))
    full_loop = write_method(tmp_path / "greedy", TRANSFORMERS_STYLE_GREEDY)
    with pytest.raises(ValueError, match="replaces the whole decoding loop"):
        to_transformers(hf, method=str(full_loop), trust_remote_code=True)


def test_hub_methods_run_on_a_wrapped_model(hf, hub, tmp_path):
    hub.repos.push_dir("acme/greedy", write_method(tmp_path / "greedy", TRANSFORMERS_STYLE_GREEDY))
    hub.repos.push_dir("acme/ban", write_method(tmp_path / "ban", HOOK_METHOD))
    model = wrap(hf)
    assert torch.equal(
        model.generate(PROMPT, custom_generate="acme/greedy", trust_remote_code=True, max_new_tokens=NEW),
        in_decodekit(hf),
    )
    banned = model.generate(
        PROMPT,
        custom_generate="acme/ban",
        trust_remote_code=True,
        banned_token=4,
        max_new_tokens=NEW,
        eos_token_id=None,
    )
    assert torch.equal(
        banned, in_transformers(hf, to_transformers(hf, method="acme/ban", trust_remote_code=True, banned_token=4))
    )
    with pytest.raises(UntrustedCodeError):
        model.generate(PROMPT, custom_generate="acme/ban", banned_token=4)


def test_the_default_model_through_transformers_equals_transformers_greedy(
    default_model, default_model_in_transformers
):
    _, tokenizer = default_model
    model = default_model_in_transformers
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        theirs = model.module.generate(ids, max_new_tokens=16, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=16), theirs), text
    first = tokenizer(prompts[0], return_tensors="pt")["input_ids"]
    assert tokenizer.decode(model.generate(first, max_new_tokens=4)[0, first.shape[1] :]).startswith(" Paris")


def test_cli_generates_with_a_transformers_model(tmp_path, capsys):
    import json

    from decodekit.cli import main

    hf = tiny_transformers_model("gpt2")
    hf.save_pretrained(tmp_path)
    # Byte-level BPE with no merges: one token per printable character, as many tokens as the model's vocabulary.
    vocab = {"<|endoftext|>": 0, "Ġ": 1, **{chr(c): c - 31 for c in range(33, 127)}}
    assert len(vocab) == hf.config.vocab_size
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    assert main(["generate", "abc", "--model", str(tmp_path), "--max-new-tokens", "5", "--no-stream"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("abc") and len(out) > 3
    (tmp_path / "model.safetensors").unlink()
    assert main(["generate", "abc", "--model", str(tmp_path)]) == 2
    assert "no file named" in capsys.readouterr().err


@pytest.mark.parametrize("hook", ["logits processor", "selector"])
def test_rendered_hook_methods_take_transformers_arguments_under_its_custom_generate(hf, tmp_path, hook):
    """transformers passes its own GenerationConfig and processors to the entry point; both are honoured,
    in transformers' loop (a processor method) and in decodekit's loop on the model (a selector method)."""
    from decodekit.templates import render

    repo = render("hub-repo", tmp_path, {"name": "M", "hook_point": hook}, no_input=True)
    seen = []

    def spy(input_ids, scores):
        seen.append(input_ids.shape[1])
        return scores

    config = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    out = hf.generate(
        PROMPT,
        custom_generate=str(repo),
        trust_remote_code=True,
        generation_config=config,
        logits_processor=transformers.LogitsProcessorList([spy]),
    )
    assert out.shape == (1, PROMPT.shape[1] + 4) and seen == [5, 6, 7, 8]
