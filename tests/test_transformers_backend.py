"""decodekit's generate() on transformers models (decodekit.wrap), against transformers' own generate() on the
same object: token for token, batch 1 and left-padded batches, beam search scores, every strategy."""

import logging

import pytest
import torch

import decodekit
from decodekit import AutoModelForCausalLM

from tiny_transformers import ARCHITECTURES, EOS, PAD, oracle_arguments, tiny_transformers_model, transformers

from decodekit.facade.transformers_model import masks_prompt_only  # noqa: E402
from decodekit.integrations.transformers import wrap  # noqa: E402  (after the importorskip)

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
BATCH = torch.tensor([[PAD, PAD, 5, 6, 7], [PAD, 8, 9, 10, 11], [12, 13, 14, 15, 16]])
NEW = 12


def reference(hf, ids, **kwargs):
    """transformers' generate with the same stopping rule as decodekit's calls below (no EOS), without a cache where
    its cached run is wrong (tiny_transformers.CACHE_WRONG_IN_TRANSFORMERS)."""
    return hf.generate(
        ids, do_sample=False, eos_token_id=None, pad_token_id=PAD, max_new_tokens=NEW, **oracle_arguments(hf, kwargs)
    )


def ours(model, ids, **kwargs):
    return model.generate(ids, eos_token_id=None, max_new_tokens=NEW, **kwargs)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def pair(request):
    hf = tiny_transformers_model(request.param)
    return hf, wrap(hf)


def test_greedy_equals_transformers_batch_1(pair):
    hf, model = pair
    theirs = reference(hf, PROMPT, return_dict_in_generate=True, output_logits=True)
    mine = ours(model, PROMPT, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(mine.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(mine.logits), torch.stack(theirs.logits), atol=1e-4, rtol=1e-4)


def test_greedy_equals_transformers_left_padded_batch_of_3(pair):
    hf, model = pair
    mask = (BATCH != PAD).long()
    theirs = reference(hf, BATCH, attention_mask=mask, return_dict_in_generate=True, output_logits=True)
    mine = ours(model, BATCH, attention_mask=mask, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(mine.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(mine.logits), torch.stack(theirs.logits), atol=1e-4, rtol=1e-4)


def test_beam_search_sequences_and_scores_equal_transformers(pair):
    hf, model = pair
    options = dict(num_beams=3, num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
    theirs = reference(hf, PROMPT, **options)
    mine = ours(model, PROMPT, **options)
    assert torch.equal(mine.sequences, theirs.sequences)
    torch.testing.assert_close(mine.sequences_scores, theirs.sequences_scores, atol=1e-5, rtol=1e-5)


def test_sampling_with_a_seed_is_reproducible(pair):
    _, model = pair
    first, again = (ours(model, PROMPT, do_sample=True, top_k=0, seed=7) for _ in range(2))
    other = ours(model, PROMPT, do_sample=True, top_k=0, seed=8)
    assert torch.equal(first, again) and not torch.equal(first, other)


# The rest of the differential suite: every architecture x each strategy family, transformers 5.23's generate() on
# the same object as the oracle. Where transformers itself fails on an architecture, decodekit must give what the
# strategy defines (speculative decoding: greedy's tokens) or refuse with a reason; never a silent other answer.
LONG = torch.tensor([[5, 6, 7, 5, 6, 7, 8, 5, 6, 7, 9, 10]])  # repeats, so prompt lookup finds candidates
PROCESSORS = dict(
    repetition_penalty=1.3,
    no_repeat_ngram_size=3,
    bad_words_ids=[[20], [21, 22]],
    min_new_tokens=4,
    suppress_tokens=[30, 31],
    sequence_bias={(40,): 3.0},
    eos_token_id=EOS,
)


def oracle_or_none(run):
    try:
        return run()
    except Exception:  # transformers' own failure on this architecture: the case then checks against greedy
        return None


def test_processors_equal_transformers(pair):
    hf, model = pair
    assert torch.equal(
        model.generate(PROMPT, max_new_tokens=NEW, **PROCESSORS),
        hf.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **PROCESSORS),
    )


def test_repetition_penalty_on_a_left_padded_batch_equals_transformers(pair):
    hf, model = pair
    mask = (BATCH != PAD).long()
    assert torch.equal(
        ours(model, BATCH, attention_mask=mask, repetition_penalty=1.8),
        reference(hf, BATCH, attention_mask=mask, repetition_penalty=1.8),
    )


def test_first_sampling_scores_equal_transformers(pair):
    # The first step's processed scores: sampling with every warper, and beam sampling (whose warpers keep
    # len(eos) + 1 tokens so a beam can always go on), where the random draws that follow differ by design.
    hf, model = pair
    common = dict(
        do_sample=True,
        max_new_tokens=1,
        return_dict_in_generate=True,
        output_scores=True,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    for options in (
        dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, top_h=0.9),
        dict(num_beams=3, num_return_sequences=2, temperature=0.7, top_k=10, top_p=0.8),
    ):
        torch.testing.assert_close(
            model.generate(PROMPT, **common, **options).scores[0],
            hf.generate(PROMPT, **common, **options).scores[0],
            atol=1e-4,
            rtol=1e-4,
        )


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("strategy", ["assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"])
def test_speculative_decoding_gives_greedy_tokens_as_transformers(architecture, strategy):
    option = {
        "assistant_model": lambda: tiny_transformers_model(architecture, seed=5),
        "prompt_lookup_num_tokens": lambda: 3,
        "assistant_early_exit": lambda: 1,
    }[strategy]()
    # Each side on its own copy: transformers' early exit, where it fails, leaves its model's config changed.
    hf = tiny_transformers_model(architecture)
    greedy = reference(hf, LONG)
    try:
        mine = ours(wrap(hf), LONG, **{strategy: option})
    except ValueError as error:
        mine = error
    theirs = oracle_or_none(lambda: reference(tiny_transformers_model(architecture), LONG, **{strategy: option}))
    if isinstance(mine, ValueError):  # a refusal names why, and only where transformers fails too
        assert ("recurrent" in str(mine) or "use_cache=True" in str(mine)) and theirs is None, mine
        return
    assert torch.equal(mine, greedy)
    if theirs is not None:
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("architecture", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("weight", [0.3, 0.7])
def test_ensemble_verification_greedy_equals_transformers(architecture, weight):
    # transformers 5.23's assistant_ensemble_weight: candidates checked against w * p + (1 - w) * q. An assistant that
    # disagrees with the model (another seed) makes the mixture choose other tokens than greedy's at some steps.
    hf, assistant = tiny_transformers_model(architecture), tiny_transformers_model(architecture, seed=5)
    draft = dict(num_assistant_tokens=4, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    for name, value in draft.items():  # transformers reads the draft's settings from the assistant's own config
        setattr(assistant.generation_config, name, value)
    options = dict(assistant_ensemble_weight=weight, **draft)
    theirs = reference(hf, LONG, assistant_model=assistant, **options)
    mine = ours(wrap(hf), LONG, assistant_model=assistant, **options)
    assert torch.equal(mine, theirs)
    if (architecture, weight) == ("llama", 0.3):  # the mixture did choose: not greedy's tokens
        assert not torch.equal(mine, reference(hf, LONG))


def test_ensemble_verification_is_refused_where_the_draft_has_no_distribution():
    model = wrap(tiny_transformers_model("llama"))
    with pytest.raises(ValueError, match="assistant_ensemble_weight verifies .* not prompt lookup"):
        ours(model, LONG, prompt_lookup_num_tokens=3, assistant_ensemble_weight=0.5)
    with pytest.raises(
        ValueError,
        match=r"assistant_ensemble_weight=1\.0 is invalid; expected a number in the open "
        r"interval \(0, 1\)",
    ):
        ours(model, LONG, assistant_model=tiny_transformers_model("llama", seed=5), assistant_ensemble_weight=1.0)


def test_static_cache_equals_transformers(pair):
    hf, model = pair
    mask = (BATCH != PAD).long()
    dynamic = reference(hf, BATCH, attention_mask=mask)
    theirs = oracle_or_none(lambda: reference(hf, BATCH, attention_mask=mask, cache_implementation="static"))
    mine = ours(model, BATCH, attention_mask=mask, cache_implementation="static")
    assert torch.equal(mine, dynamic)  # a cache's layout never changes the tokens
    if theirs is not None and torch.equal(theirs, dynamic):  # GPT-Neo's static output differs from its own dynamic one
        assert torch.equal(mine, theirs)


# --- one architecture, every strategy and hook point ----------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2():
    hf = tiny_transformers_model("gpt2")
    return hf, wrap(hf)


def test_wrap_shares_the_model_and_changes_nothing_in_it(gpt2):
    hf, model = gpt2
    before = {name: p.data_ptr() for name, p in hf.named_parameters()}
    hf_generate, hf_config = hf.generate, hf.generation_config.to_dict()
    ours(model, PROMPT, num_beams=2)
    assert {name: p.data_ptr() for name, p in hf.named_parameters()} == before
    assert hf.generate == hf_generate and hf.generation_config.to_dict() == hf_config
    assert model.module is hf and wrap(model) is model and model.lm_head is hf.lm_head
    assert model.device == hf.device and model.dtype == torch.float32 and model.config is hf.config
    assert model.generation_config.eos_token_id == EOS and model.generation_config.pad_token_id == PAD


def test_the_models_generation_config_sets_the_defaults():
    hf = tiny_transformers_model("opt")
    hf.generation_config = transformers.GenerationConfig(
        max_new_tokens=3, do_sample=True, temperature=0.5, cache_implementation="hybrid", eos_token_id=[EOS, 3]
    )
    gc = wrap(hf).generation_config
    assert (gc.max_new_tokens, gc.do_sample, gc.temperature, gc.eos_token_ids) == (3, True, 0.5, [EOS, 3])
    assert gc.cache_implementation is None and gc.pad_token_id == PAD  # pad from config.json
    assert wrap(hf).generate(PROMPT, seed=0).shape == (1, PROMPT.shape[1] + 3)


@pytest.mark.parametrize(
    "options",
    [
        dict(prompt_lookup_num_tokens=3),
        dict(assistant_model="wrapped"),
        dict(assistant_model="transformers"),
        dict(cache_implementation="static"),
        dict(compile=True),
    ],
    ids=["prompt-lookup", "assistant-wrapped", "assistant-transformers", "static-cache", "compile"],
)
def test_strategies_that_keep_greedy_output(gpt2, options, caplog):
    hf, model = gpt2
    if options.get("assistant_model") == "wrapped":
        options = dict(assistant_model=wrap(tiny_transformers_model("gpt2", seed=3)))
    elif options.get("assistant_model") == "transformers":
        options = dict(assistant_model=tiny_transformers_model("gpt2", seed=3))
    with caplog.at_level(logging.INFO, logger="decodekit"):
        assert torch.equal(ours(model, PROMPT, **options), reference(hf, PROMPT))
    if "compile" in options:
        assert "falls back to the eager loop" in caplog.text


def test_classifier_free_guidance_equals_transformers(gpt2):
    hf, model = gpt2
    negative = torch.tensor([[3, 4]])
    assert torch.equal(
        ours(model, PROMPT, guidance_scale=1.5, negative_prompt_ids=negative),
        reference(hf, PROMPT, guidance_scale=1.5, negative_prompt_ids=negative),
    )


def test_processors_and_sampling_processors_equal_transformers_scores(gpt2):
    hf, model = gpt2
    options = dict(
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        min_new_tokens=4,
        bad_words_ids=[[11]],
        return_dict_in_generate=True,
        output_scores=True,
    )
    theirs, mine = reference(hf, PROMPT, **options), ours(model, PROMPT, **options)
    assert torch.equal(mine.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(mine.scores), torch.stack(theirs.scores))


def test_contrastive_diverse_beam_and_dola_run_and_are_deterministic(gpt2):
    _, model = gpt2
    for options in (
        dict(penalty_alpha=0.6, top_k=4),
        dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
        dict(dola_layers=[0], repetition_penalty=1.2),
    ):
        first, again = ours(model, PROMPT, **options), ours(model, PROMPT, **options)
        assert torch.equal(first, again) and first.shape == (1, PROMPT.shape[1] + NEW), options


def test_transition_scores_match_transformers(gpt2):
    hf, model = gpt2
    theirs = reference(hf, PROMPT, return_dict_in_generate=True, output_scores=True)
    mine = ours(model, PROMPT, return_dict_in_generate=True, output_scores=True)
    torch.testing.assert_close(
        model.compute_transition_scores(mine.sequences, mine.scores, normalize_logits=True),
        hf.compute_transition_scores(theirs.sequences, theirs.scores, normalize_logits=True),
    )


def test_plugins_and_callables_run_on_a_wrapped_model(gpt2):
    _, model = gpt2
    seen = []

    class Ban:
        @decodekit.hookimpl
        def decodekit_logits_processors(self):
            def ban(input_ids, scores):
                seen.append(input_ids.shape)
                return scores.index_fill(-1, torch.tensor([int(plain[0, -1])]), -float("inf"))

            return [ban]

    plain = ours(model, PROMPT)
    decodekit.register(Ban(), name="ban-last")
    try:
        banned = ours(model, PROMPT)
    finally:
        decodekit.unregister("ban-last")
    assert len(seen) == NEW and int(plain[0, -1]) not in banned[0, PROMPT.shape[1] :].tolist()

    def loop(model, input_ids, logits_processor, stopping_criteria, generation_config, past_key_values=None, **kw):
        out = model(input_ids, past_key_values=past_key_values, use_cache=True)
        return torch.cat((input_ids, out.logits[:, -1:].argmax(-1)), dim=-1), type(past_key_values).__module__

    sequences, cache_module = model.generate(PROMPT, custom_generate=loop, max_new_tokens=1)
    assert torch.equal(sequences, plain[:, : PROMPT.shape[1] + 1]) and cache_module.startswith("transformers")


def test_a_plugin_cache_must_be_a_transformers_cache_for_a_transformers_model(gpt2):
    _, model = gpt2

    class Static:
        @decodekit.hookimpl
        def decodekit_cache(self, context):
            return context.model.make_cache("static", context.batch_size, context.max_length)

    decodekit.register(Static(), name="static-cache")
    try:
        out = ours(model, PROMPT, return_dict_in_generate=True)
    finally:
        decodekit.unregister("static-cache")
    assert type(out.past_key_values).__name__ == "StaticCache"
    assert torch.equal(out.sequences, ours(model, PROMPT))


# --- loading -------------------------------------------------------------------------------------------------


def test_auto_model_loads_other_architectures_through_transformers(tmp_path, caplog):
    hf = tiny_transformers_model("gpt_neox")
    hf.save_pretrained(tmp_path / "neox")
    with caplog.at_level(logging.INFO, logger="decodekit"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "neox")
    assert isinstance(model, decodekit.Model)
    assert "transformers backend: model_type 'gpt_neox' has no native implementation" in caplog.text
    assert torch.equal(ours(model, PROMPT), reference(hf, PROMPT))


def test_backend_can_be_forced_and_is_checked(tmp_path):
    from decodekit.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "llama")
    native = AutoModelForCausalLM.from_pretrained(path)
    through = AutoModelForCausalLM.from_pretrained(path, backend="transformers")
    # One class over both backends: what differs is the module it holds.
    assert (native.backend, through.backend) == ("native", "transformers")
    assert isinstance(through.module, transformers.PreTrainedModel) and not isinstance(
        native.module, transformers.PreTrainedModel
    )
    assert torch.equal(native.generate(PROMPT, max_new_tokens=8), through.generate(PROMPT, max_new_tokens=8))
    tiny_transformers_model("opt").save_pretrained(tmp_path / "opt")
    with pytest.raises(ValueError, match="model_type 'opt' has no native implementation"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "opt", backend="native")
    with pytest.raises(ValueError, match=r"backend='onnx' is invalid; expected one of \['native', 'transformers'\]"):
        AutoModelForCausalLM.from_pretrained(path, backend="onnx")
    with pytest.raises(ValueError, match="quantize='int8' applies to decodekit's native models"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "opt", quantize="int8")
    with pytest.raises(TypeError, match=r"decodekit.wrap\(model\)"):
        AutoModelForCausalLM.from_pretrained(native)


def test_without_transformers_the_error_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    tiny_transformers_model("opt").save_pretrained(tmp_path / "opt")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install 'decodekit\[transformers\]'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "opt")


def test_a_model_transformers_cannot_load_says_why(tmp_path):
    hf = tiny_transformers_model("opt")
    hf.config.save_pretrained(tmp_path / "no-weights")
    with pytest.raises(OSError, match="no file named"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "no-weights")


def test_tokenizer_falls_back_to_transformers(tmp_path, caplog):
    import json

    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3, "Ġ": 4, "Ġab": 5}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nĠ ab\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with caplog.at_level(logging.INFO, logger="decodekit"):
        tokenizer = decodekit.AutoTokenizer.from_pretrained(tmp_path)
    assert "no tokenizer.json" in caplog.text and tokenizer.padding_side == "left"
    assert tokenizer("ab ab")["input_ids"] == [3, 5] and tokenizer.decode([3, 5]) == "ab ab"


# --- bad input -----------------------------------------------------------------------------------------------


def test_wrap_refuses_what_is_not_a_decoder_only_causal_lm():
    with pytest.raises(TypeError, match="takes a transformers causal LM"):
        wrap(torch.nn.Linear(2, 2))
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
        )
    )
    with pytest.raises(ValueError, match="not a causal language model"):
        wrap(bert)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=32, d_model=16, d_ff=16, num_layers=1, num_heads=2, d_kv=8)
    )
    with pytest.raises(ValueError, match="encoder-decoder model; decodekit generates with decoder-only models only"):
        wrap(t5)


def test_a_wrapped_model_can_be_copied(gpt2):
    import copy

    hf, model = gpt2
    twin = copy.copy(model)
    assert twin.module is hf and torch.equal(ours(twin, PROMPT), ours(model, PROMPT))


# Where transformers' own guidance differs from the oracle without any cache (unconditional_guidance) and decodekit's
# equals it (docs/transformers.md): Bamba's and MiniMax's unconditional runs in transformers' processor.
GUIDANCE_WRONG_IN_TRANSFORMERS = {"bamba", "minimax"}


def unconditional_guidance(hf, prompt, scale: float, steps: int) -> torch.Tensor:
    """Greedy decoding with classifier-free guidance computed without any cache: the oracle for models whose
    guidance transformers runs without their cache (a state-space model's forward takes cache_params or cache, and its
    unconditional run is handed past_key_values, which it ignores)."""
    ids, unconditional = prompt, prompt[:, -1:]
    for _ in range(steps):
        with torch.no_grad():
            cond = hf(ids).logits[:, -1].log_softmax(-1)
            uncond = hf(unconditional).logits[:, -1].log_softmax(-1)
        token = (scale * (cond - uncond) + uncond).argmax(-1, keepdim=True)
        ids, unconditional = torch.cat((ids, token), 1), torch.cat((unconditional, token), 1)
    return ids


def test_guidance_and_watermark_equal_transformers(pair):
    hf, model = pair
    watermark = dict(watermarking_config={"bias": 2.5, "greenlist_ratio": 0.5})
    assert torch.equal(ours(model, PROMPT, **watermark), reference(hf, PROMPT, **watermark))
    if model.holds_recurrent_state:  # RecurrentGemma: refused with the reason
        with pytest.raises(ValueError, match="keeps its recurrent state in its own layers"):
            ours(model, PROMPT, guidance_scale=1.5)
    elif masks_prompt_only(hf) or hf.config.model_type in GUIDANCE_WRONG_IN_TRANSFORMERS:
        assert torch.equal(ours(model, PROMPT, guidance_scale=1.5), unconditional_guidance(hf, PROMPT, 1.5, NEW))
    else:  # where transformers' own guidance fails (OpenAI GPT: a model without a cache), the oracle without one
        theirs = oracle_or_none(lambda: reference(hf, PROMPT, guidance_scale=1.5))
        expected = theirs if theirs is not None else unconditional_guidance(hf, PROMPT, 1.5, NEW)
        assert torch.equal(ours(model, PROMPT, guidance_scale=1.5), expected)


@pytest.mark.parametrize("architecture", ["mamba", "jamba", "recurrent_gemma"])
def test_every_other_strategy_runs_on_state_space_models_or_says_why(architecture):
    # No transformers oracle for these here (contrastive search and DoLa moved to Hub repos in transformers 5):
    # each runs and keeps the prompt, the chunked prefill gives greedy's tokens, and a choice that cannot apply
    # is refused with the reason.
    model = wrap(tiny_transformers_model(architecture))
    greedy = ours(model, LONG)
    assert torch.equal(ours(model, LONG, prefill_chunk_size=4), greedy)
    strategies = [
        dict(dola_layers=[0, 1], repetition_penalty=1.2),
        dict(compile=True),
        dict(do_sample=True, num_beams=3, seed=0),
        dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5),
    ]
    if not model.holds_recurrent_state:
        strategies.append(dict(penalty_alpha=0.6, top_k=4))
    else:
        with pytest.raises(ValueError, match="contrastive search .* keeps its recurrent state"):
            ours(model, LONG, penalty_alpha=0.6, top_k=4)
    for options in strategies:
        out = ours(model, LONG, **options)
        assert torch.equal(out[:, : LONG.shape[1]], LONG) and out.shape[1] == LONG.shape[1] + NEW, options
    if model.config.tie_word_embeddings:
        with pytest.raises(ValueError, match=f"picks no layer of this {model.config.num_hidden_layers}-layer model"):
            ours(model, LONG, dola_layers="low")


# --- Hub methods written for transformers, and mixed native / transformers speculative pairs -----------------------


def test_a_method_using_transformers_internals_runs_on_a_wrapped_model_as_on_transformers(tmp_path):
    from methods import TRANSFORMERS_INTERNALS, write_method

    hf = tiny_transformers_model("llama")
    repo = str(write_method(tmp_path / "internals", TRANSFORMERS_INTERNALS))
    options = dict(max_new_tokens=6, repetition_penalty=1.3, eos_token_id=None, pad_token_id=PAD)
    theirs = hf.generate(PROMPT, custom_generate=repo, trust_remote_code=True, **options)
    assert torch.equal(theirs, hf.generate(PROMPT, do_sample=False, **options))
    assert torch.equal(wrap(hf).generate(PROMPT, custom_generate=repo, trust_remote_code=True, **options), theirs)


def test_methods_get_the_calls_prepared_config_on_both_backends(tmp_path):
    from methods import LENGTHS_FROM_CONFIG, write_method

    from helpers import write_tiny_model

    repo = str(write_method(tmp_path / "lengths", LENGTHS_FROM_CONFIG))
    native = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "native"))
    for model in (native, wrap(tiny_transformers_model("llama"))):
        greedy = model.generate(PROMPT, max_new_tokens=5, eos_token_id=None)
        assert torch.equal(
            model.generate(PROMPT, custom_generate=repo, trust_remote_code=True, max_new_tokens=5), greedy
        )
        by_length = model.generate(PROMPT, custom_generate=repo, trust_remote_code=True, max_length=8)
        assert by_length.shape == (1, 8)


def test_a_native_target_with_a_plain_transformers_assistant_and_the_reverse(tmp_path):
    from helpers import write_tiny_model

    path = write_tiny_model(tmp_path / "llama")
    native = AutoModelForCausalLM.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    greedy = native.generate(LONG, max_new_tokens=NEW, eos_token_id=None)
    assert torch.equal(native.generate(LONG, max_new_tokens=NEW, eos_token_id=None, assistant_model=hf), greedy)
    assert torch.equal(wrap(hf).generate(LONG, max_new_tokens=NEW, eos_token_id=None, assistant_model=native), greedy)


@pytest.mark.parametrize("architecture", ["gpt2", "llama", "opt"])
def test_finished_beams_are_filled_as_transformers_fills_them(architecture):
    # pad_token_id=0 counts as unset in transformers' fill (`pad or eos[0]`): beams that end early are filled with
    # EOS there, and so here, where a literal pad 0 was written before.
    hf = tiny_transformers_model(architecture)
    plain = reference(hf, PROMPT)
    for step in (1, 2, 3):
        eos = int(plain[0, PROMPT.shape[1] + step])
        options = dict(
            num_beams=4,
            num_return_sequences=3,
            early_stopping=True,
            length_penalty=0.5,
            pad_token_id=0,
            eos_token_id=eos,
            max_new_tokens=10,
        )
        theirs = hf.generate(PROMPT, do_sample=False, **options)
        assert torch.equal(wrap(hf).generate(PROMPT, **options), theirs)


@pytest.mark.parametrize("architecture", ["mamba", "jamba", "recurrent_gemma"])
def test_continuous_batching_on_state_space_models_equals_generate_or_says_why(architecture):
    model = wrap(tiny_transformers_model(architecture))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    if model.holds_recurrent_state:  # RecurrentGemma: requests would share the layers' state
        with pytest.raises(ValueError, match="keeps its recurrent state in its own layers"):
            model.generate_batch(prompts, max_new_tokens=4, eos_token_id=None, progress_bar=False)
        return
    out = model.generate_batch(prompts, max_new_tokens=4, eos_token_id=None, progress_bar=False)
    for prompt, result in zip(prompts, out.values()):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=4, eos_token_id=None)[0, len(prompt) :].tolist()
        assert result.generated_tokens == alone
