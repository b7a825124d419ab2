"""Hub methods written for transformers run on decodekit's own models, unchanged: the same method on transformers'
model from the same checkpoint is the oracle (tests/published_methods.py holds the methods)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from decodekit import AutoModelForCausalLM
from decodekit.facade.as_transformers import OUTPUT_CACHE
from helpers import PATIENCE, write_tiny_model
from methods import HOOK_METHOD, TRANSFORMERS_INTERNALS, TRANSFORMERS_STYLE_GREEDY, write_method
from published_methods import (
    BEAM_LOOP,
    CONTRASTIVE,
    ENCODER_DECODER,
    REENTERS_GENERATE,
    ROLLBACK,
    SINK_CACHE,
    TOP_N_SIGMA,
)
from tiny_transformers import PAD, transformers

# transformers' StaticCache crops from 5.24 on: before, a method cropping one has no transformers oracle to agree with.
STATIC_CROPS = hasattr(transformers.cache_utils.StaticLayer, "crop")
NO_STATIC_CROP = f"transformers {transformers.__version__}'s StaticCache cannot crop (5.24's can): no oracle"

PROMPT = torch.tensor([[5, 9, 13, 2, 7]])
STUCK = torch.tensor([[3, 3, 3]])  # plain greedy on the tiny llama repeats a token a few steps on
PADDED = torch.tensor([[PAD, PAD, 5, 9, 13], [4, 8, 12, 2, 7]])
PADDED_MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param) / "model", request.param)


@pytest.fixture(scope="module")
def models(checkpoint):
    native = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert native.backend == "native"
    return native, transformers.AutoModelForCausalLM.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    sources = dict(
        top_n_sigma=TOP_N_SIGMA,
        beams=BEAM_LOOP,
        rollback=ROLLBACK,
        internals=TRANSFORMERS_INTERNALS,
        contrastive=CONTRASTIVE,
        sink=SINK_CACHE,
        reenters=REENTERS_GENERATE,
        encoder_decoder=ENCODER_DECODER,
        hooks=HOOK_METHOD,
        greedy=TRANSFORMERS_STYLE_GREEDY,
    )
    return {name: str(write_method(root / name, source)) for name, source in sources.items()}


def both(models, repo, seed=None, **options):
    """The method's tokens on transformers' model and on the native model, each from the same seed."""
    outs = []
    for model in reversed(models):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(model.generate(custom_generate=repo, trust_remote_code=True, **options))
    return outs


CASES = {
    "top-n-sigma greedy": ("top_n_sigma", dict(input_ids=PROMPT, max_new_tokens=8, n_sigma=1.5, eos_token_id=None)),
    "top-n-sigma padded": (
        "top_n_sigma",
        dict(input_ids=PADDED, attention_mask=PADDED_MASK, max_new_tokens=6, pad_token_id=PAD, eos_token_id=None),
    ),
    "top-n-sigma with processors": (
        "top_n_sigma",
        dict(input_ids=PROMPT, max_new_tokens=8, repetition_penalty=1.4, no_repeat_ngram_size=2, eos_token_id=None),
    ),
    "beam loop": ("beams", dict(input_ids=PROMPT, max_new_tokens=6, num_beams=3)),
    "beam loop padded": ("beams", dict(input_ids=PADDED, attention_mask=PADDED_MASK, max_new_tokens=5, num_beams=2)),
    "rollback, dynamic cache": ("rollback", dict(input_ids=STUCK, max_new_tokens=12)),
    "rollback, static cache": ("rollback", dict(input_ids=STUCK, max_new_tokens=12, cache_kind="static")),
    "contrastive search": (
        "contrastive",
        dict(input_ids=PROMPT, max_new_tokens=8, penalty_alpha=0.6, top_k=4, eos_token_id=None),
    ),
    "contrastive search padded": (
        "contrastive",
        dict(
            input_ids=PADDED,
            attention_mask=PADDED_MASK,
            max_new_tokens=5,
            penalty_alpha=0.6,
            top_k=3,
            pad_token_id=PAD,
            eos_token_id=None,
        ),
    ),
    "sink cache": ("sink", dict(input_ids=PROMPT, max_new_tokens=12, sink=2, window=8)),
    "re-enters generate()": ("reenters", dict(input_ids=PROMPT, max_new_tokens=6)),
    "internals loop": (
        "internals",
        dict(input_ids=PROMPT, max_new_tokens=6, repetition_penalty=1.3, eos_token_id=None, pad_token_id=PAD),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_published_method_gives_transformers_tokens_on_a_native_model(models, repos, case):
    name, options = CASES[case]
    if options.get("cache_kind") == "static" and not STATIC_CROPS:
        pytest.skip(NO_STATIC_CROP)
    theirs, ours = both(models, repos[name], **options)
    assert theirs.shape[1] > options["input_ids"].shape[1]
    assert torch.equal(ours, theirs), (theirs.tolist(), ours.tolist())


def repeats(tokens: list[int]) -> bool:
    return any(a == b for a, b in zip(tokens, tokens[1:]))


def test_the_rollback_method_does_roll_back(models, repos):
    native, theirs = models
    stuck = next(
        prompt
        for prompt in (torch.full((1, 3), token) for token in range(2, 60))
        if repeats(native.generate(prompt, max_new_tokens=12, eos_token_id=None)[0, 3:].tolist())
    )
    greedy = native.generate(stuck, max_new_tokens=12, eos_token_id=None)
    for cache_kind in ("dynamic", "static") if STATIC_CROPS else ("dynamic",):
        options = dict(input_ids=stuck, max_new_tokens=12, cache_kind=cache_kind)
        rolled = native.generate(custom_generate=repos["rollback"], trust_remote_code=True, **options)
        assert greedy.shape == rolled.shape and not torch.equal(greedy, rolled) and not repeats(rolled[0, 3:].tolist())
        assert torch.equal(
            rolled, theirs.generate(custom_generate=repos["rollback"], trust_remote_code=True, **options)
        )


def test_seeded_sampling_in_a_published_loop_matches_transformers(models, repos):
    for seed in (0, 1, 2):
        theirs, ours = both(
            models,
            repos["top_n_sigma"],
            seed=seed,
            input_ids=PROMPT,
            max_new_tokens=8,
            do_sample=True,
            n_sigma=2.0,
            eos_token_id=None,
        )
        assert torch.equal(ours, theirs), seed


def test_transformers_generate_on_the_native_view_gives_its_scores(models):
    native, theirs = models
    options = dict(
        max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True, eos_token_id=None
    )
    expected = theirs.generate(PROMPT, **options)
    got = transformers.GenerationMixin.generate(native.as_transformers(), PROMPT, **options)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, reference in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
    beams = dict(max_new_tokens=5, num_beams=3, do_sample=False, cache_implementation="static", eos_token_id=None)
    assert torch.equal(
        transformers.GenerationMixin.generate(native.as_transformers(), PROMPT, **beams),
        theirs.generate(PROMPT, **beams),
    )


def test_the_view_answers_as_a_transformers_model_does(models):
    native, theirs = models
    view = native.as_transformers()
    assert view.config.is_encoder_decoder is False and view.config.get_text_config() is view.config
    assert type(view.generation_config) is transformers.GenerationConfig
    assert native.config.is_encoder_decoder is False and native.config.get_text_config() is native.config
    assert view._supports_logits_to_keep() and view.can_generate()
    # Internals a method calls on the model itself come from transformers too (one was a bare AttributeError).
    arguments = (None, {"tokenizer": None}, None, None, None)
    assert native._extract_generation_mode_kwargs(*arguments) == theirs._extract_generation_mode_kwargs(*arguments)
    ids = torch.tensor([[5, 9, 13, 2, 7, 36]])
    cache = transformers.DynamicCache(config=view.config)
    out = view(ids, cache=cache, output_hidden_states=True)
    reference = theirs(ids, output_hidden_states=True)
    assert getattr(out, OUTPUT_CACHE) is cache and cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-4, atol=1e-4)
    assert len(out.hidden_states) == len(reference.hidden_states)
    for mine, theirs_layer in zip(out.hidden_states, reference.hidden_states):
        torch.testing.assert_close(mine, theirs_layer, rtol=1e-4, atol=1e-4)
    # A method's beam loop reorders the cache through the model, as 4.5x's models let it.
    cache.crop(-1)
    assert view._reorder_cache(cache, torch.tensor([0])) is cache and cache.get_seq_length() == ids.shape[1] - 1


def test_bf16_and_int8_native_models_run_published_methods(checkpoint, repos):
    """The method's forward is the native model's (its kernels, its weights): in bf16 and with int8 weights it gives
    what decodekit's own greedy loop gives on that model."""
    for options in (dict(dtype=torch.bfloat16), dict(quantize="int8")):
        native = AutoModelForCausalLM.from_pretrained(checkpoint, **options)
        greedy = native.generate(PROMPT, max_new_tokens=6, eos_token_id=None)
        method = native.generate(
            input_ids=PROMPT,
            max_new_tokens=6,
            n_sigma=100.0,
            eos_token_id=None,
            custom_generate=repos["top_n_sigma"],
            trust_remote_code=True,
        )
        assert torch.equal(method, greedy), options


def test_a_method_asking_for_another_kind_of_model_is_told_what_it_asked_for(models, repos):
    native = models[0]
    with pytest.raises(
        ValueError,
        match=r"asks the model for get_encoder \(line 3\), which an encoder-decoder model "
        r"has; encoder_outputs= \(line 4\), an input of an encoder-decoder model\. "
        r".*backend='transformers'",
    ):
        native.generate(input_ids=PROMPT, custom_generate=repos["encoder_decoder"], trust_remote_code=True)
    with pytest.raises(AttributeError, match=r"asked the model for 'get_encoder'.*backend='transformers'"):
        native.as_transformers().get_encoder()
    with pytest.raises(TypeError, match=r"encoder_outputs=, an input of an encoder-decoder model"):
        native.as_transformers()(PROMPT, encoder_outputs=(torch.zeros(1, 5, 8),))
    with pytest.raises(ValueError, match=r"output_attentions=True: decodekit's native models"):
        native.as_transformers()(PROMPT, output_attentions=True)


def test_without_transformers_a_method_importing_it_names_the_extra(checkpoint, repos):
    script = textwrap.dedent(f"""
        import importlib.abc, sys

        class NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "transformers":
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

        sys.meta_path.insert(0, NotInstalled())
        import torch
        from decodekit import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(checkpoint)!r})
        prompt = torch.tensor([[5, 9, 13, 2, 7]])
        try:
            model.generate(input_ids=prompt, custom_generate={repos["top_n_sigma"]!r}, trust_remote_code=True)
        except ImportError as error:
            print("refused:", error)
        greedy = model.generate(prompt, max_new_tokens=4, eos_token_id=None)
        full_loop = model.generate(prompt, max_new_tokens=4, custom_generate={repos["greedy"]!r}, trust_remote_code=True)
        hooks = model.generate(prompt, max_new_tokens=4, custom_generate={repos["hooks"]!r}, trust_remote_code=True)
        print("equal:", torch.equal(full_loop, greedy), "hooks:", hooks.shape[1] == 9)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=PATIENCE)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refused:" in result.stdout and "pip install 'decodekit[transformers]'" in result.stdout
    assert "equal: True hooks: True" in result.stdout


def test_a_sliding_window_model_gives_transformers_tokens(tmp_path, repos):
    """Mistral with a 4-token window over a 7-token prompt: transformers' caches slide, the view's keep every position
    and the native model masks the window; the tokens agree."""
    path = write_tiny_model(tmp_path / "mistral", "mistral", sliding_window=4)
    native = AutoModelForCausalLM.from_pretrained(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path)
    prompt = torch.tensor([[5, 9, 13, 2, 7, 11, 3]])
    for name, options in (
        ("top_n_sigma", dict(max_new_tokens=10, eos_token_id=None)),
        ("beams", dict(max_new_tokens=6, num_beams=2)),
        ("rollback", dict(max_new_tokens=10, cache_kind="static", max_rollbacks=0)),
    ):
        theirs_out, ours = both((native, theirs), repos[name], input_ids=prompt, **options)
        assert torch.equal(ours, theirs_out), name
