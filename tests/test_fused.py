"""The fused, compiled decode step: same output as the eager loop, no recompilation within a cache bucket,
and an eager fallback that says why."""

import logging

import pytest
import torch

from decodekit.kernels import native
from decodekit.core.compile import argument_guards_only
from decodekit.kernels import StepHost
from decodekit.core.fused_loop import bucket
from decodekit.testing import tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("fused"), "mistral")  # sliding window: the mask path is exercised


PROMPT = torch.tensor([[5, 9, 14, 3, 7]])
BATCH = torch.tensor([[5, 9, 14, 3, 7, 8], [0, 0, 0, 4, 5, 6], [0, 11, 12, 13, 14, 15]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]])


def test_compiled_greedy_equals_eager(model):
    for kwargs in (dict(input_ids=PROMPT), dict(input_ids=BATCH, attention_mask=MASK)):
        eager = model.generate(**kwargs, max_new_tokens=24)
        compiled = model.generate(**kwargs, max_new_tokens=24, compile=True)
        assert torch.equal(eager, compiled)


def test_compiled_sampling_equals_eager_for_the_same_seed(model):
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=11, eos_token_id=None)
    assert torch.equal(model.generate(PROMPT, **kwargs), model.generate(PROMPT, compile=True, **kwargs))


def test_eos_and_min_new_tokens_match_eager(model):
    plain = model.generate(BATCH, attention_mask=MASK, max_new_tokens=30, eos_token_id=None)
    eos = int(plain[0, 8])  # a token row 0 generates early: make it EOS so rows finish at different steps
    kwargs = dict(attention_mask=MASK, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    eager = model.generate(BATCH, **kwargs)
    assert eager.shape[1] < BATCH.shape[1] + 30 or (eager == 0).any()
    assert torch.equal(eager, model.generate(BATCH, compile=True, **kwargs))
    kwargs["min_new_tokens"] = 10
    assert torch.equal(model.generate(BATCH, **kwargs), model.generate(BATCH, compile=True, **kwargs))


def test_no_recompilation_within_a_bucket(model):
    from torch._dynamo.utils import counters

    model.generate(PROMPT, max_new_tokens=20, compile=True)  # compiled (or reused) for batch 1, bucket 256
    before = dict(counters["stats"])
    for n in (3, 9, 17):
        prompt = torch.arange(4, 4 + n)[None]
        model.generate(prompt, max_new_tokens=20 + n, compile=True)
    assert bucket(17 + 20 + 17) == bucket(5 + 20) == 256
    assert counters["stats"]["unique_graphs"] == before["unique_graphs"]
    model.generate(PROMPT, max_new_tokens=300, compile=True)  # the next bucket (512 slots): one new graph
    assert counters["stats"]["unique_graphs"] == before["unique_graphs"] + 1


def test_unfusable_strategies_run_eagerly_and_say_why(model, caplog):
    with caplog.at_level(logging.INFO, logger="decodekit"):
        eager = model.generate(PROMPT, max_new_tokens=8, no_repeat_ngram_size=2)
        out = model.generate(PROMPT, max_new_tokens=8, no_repeat_ngram_size=2, compile=True)
    assert torch.equal(out, eager)
    assert (
        "falls back to the eager loop: the logits processor NoRepeatNGramLogitsProcessor may read the whole sequence"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="decodekit"):
        lookup = model.generate(PROMPT, max_new_tokens=6, prompt_lookup_num_tokens=2, compile=True)
    assert torch.equal(lookup, model.generate(PROMPT, max_new_tokens=6, prompt_lookup_num_tokens=2))
    assert "prompt lookup decoding runs eagerly (it has data-dependent shapes)" in caplog.text


class FavourEos:
    """Adds `bias` to EOS's score (read from the test's eos): hypotheses finish often, searches end early."""

    score_only = True

    def __init__(self, bias):
        self.bias = bias

    def __call__(self, input_ids, scores):
        return scores + self.bias * (torch.arange(scores.shape[-1], device=scores.device) == self.eos)


BEAM_SETTINGS = [
    dict(num_beams=3),
    dict(num_beams=4, num_return_sequences=2, length_penalty=0.5, early_stopping=True, favour_eos=2.0),
    dict(num_beams=4, early_stopping="never", length_penalty=2.0, suppress_tokens=[4], favour_eos=1.0),
    dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
    dict(num_beams=3, do_sample=True, top_k=10, seed=4),
    dict(num_beams=3, min_new_tokens=12),
]


@pytest.mark.parametrize("kwargs", BEAM_SETTINGS)
def test_compiled_beam_search_equals_eager(model, kwargs, caplog):
    plain = model.generate(BATCH, attention_mask=MASK, num_beams=3, max_new_tokens=30, eos_token_id=None)
    eos = int(plain[0, BATCH.shape[1] + 3])  # a token the search makes early: hypotheses finish
    kwargs = dict(kwargs)
    if "favour_eos" in kwargs:
        favour = FavourEos(kwargs.pop("favour_eos"))
        favour.eos = eos
        kwargs["logits_processor"] = [favour]
    common = dict(
        attention_mask=MASK,
        max_new_tokens=30,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )
    eager = model.generate(BATCH, **common)
    with caplog.at_level(logging.INFO, logger="decodekit"):
        compiled = model.generate(BATCH, compile=True, **common)
    assert "falls back" not in caplog.text and "runs eagerly" not in caplog.text
    assert torch.equal(compiled.sequences, eager.sequences)
    assert torch.equal(compiled.beam_indices, eager.beam_indices)
    torch.testing.assert_close(compiled.sequences_scores, eager.sequences_scores, rtol=0, atol=1e-5)
    assert len(compiled.scores) == len(eager.scores)  # one per step the eager loop ran, no more
    for c, e in zip(compiled.scores, eager.scores):
        torch.testing.assert_close(c, e, rtol=0, atol=1e-5)
    assert compiled.past_key_values.get_seq_length() == BATCH.shape[1] + len(eager.scores) - 1
    assert (compiled.past_key_values.rows is not None) == native.loaded()  # the C++ stack's shared rows
    if "logits_processor" in kwargs:
        assert (eager.sequences[:, BATCH.shape[1] :] == eos).any()  # finished hypotheses are returned
    if kwargs.get("early_stopping") is True:
        assert len(eager.scores) < 30  # the search ended before max_length: later compiled steps changed nothing


def test_compiled_beam_search_on_the_python_layers_reorders_by_copying(tmp_path, monkeypatch):
    from decodekit.families import llama

    monkeypatch.setattr(llama, "NATIVE_LAYERS", False)
    fresh = tiny_model(tmp_path, "llama")  # a model of its own: steps are not keyed by NATIVE_LAYERS
    kwargs = dict(attention_mask=MASK, max_new_tokens=12, num_beams=3, return_dict_in_generate=True)
    compiled = fresh.generate(BATCH, compile=True, **kwargs)
    eager = fresh.generate(BATCH, **kwargs)
    assert compiled.past_key_values.rows is None
    assert torch.equal(compiled.sequences, eager.sequences) and torch.equal(compiled.beam_indices, eager.beam_indices)


def test_no_recompilation_of_beam_search_within_a_bucket(model):
    from torch._dynamo.utils import counters

    model.generate(PROMPT, max_new_tokens=20, num_beams=3, compile=True)
    before = counters["stats"]["unique_graphs"]
    for n in (3, 9, 17):
        prompt = torch.arange(4, 4 + n)[None]
        out = model.generate(prompt, max_new_tokens=20 + n, num_beams=3, compile=True)
        assert torch.equal(out, model.generate(prompt, max_new_tokens=20 + n, num_beams=3))
    assert counters["stats"]["unique_graphs"] == before


# intermediate 128: every width a multiple of 32, so the step's layers are the C++ stack; 112: the Python layers.
@pytest.mark.parametrize("intermediate", [128, 112])
def test_int8_weights_are_compiled_and_equal_eager(tmp_path, caplog, intermediate):
    from decodekit import AutoModelForCausalLM
    from decodekit.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "m", "qwen2", intermediate_size=intermediate)
    int8 = AutoModelForCausalLM.from_pretrained(path, quantize="int8")
    assert (int8.layers[0].native_operands() is not None) == (intermediate == 128)
    with caplog.at_level(logging.INFO, logger="decodekit"):
        for kwargs in (dict(input_ids=PROMPT), dict(input_ids=BATCH, attention_mask=MASK)):
            assert torch.equal(
                int8.generate(**kwargs, max_new_tokens=16), int8.generate(**kwargs, max_new_tokens=16, compile=True)
            )
        sample = dict(max_new_tokens=16, do_sample=True, top_k=20, seed=3, eos_token_id=None)
        assert torch.equal(int8.generate(PROMPT, **sample), int8.generate(PROMPT, compile=True, **sample))
    assert "compiling the decode step" in caplog.text and "falls back" not in caplog.text


def test_a_compiled_step_sees_weights_replaced_between_calls(tmp_path):
    # The C++ layer stack reads weights bound once per generate call, not passed on every step.
    fresh = tiny_model(tmp_path, "llama")
    before = fresh.generate(PROMPT, max_new_tokens=10, compile=True)
    down = fresh.layers[1].mlp.down
    down.weight = torch.nn.Parameter(-3 * down.weight.detach())
    eager = fresh.generate(PROMPT, max_new_tokens=10)
    assert not torch.equal(eager, before)  # the change matters
    assert torch.equal(fresh.generate(PROMPT, max_new_tokens=10, compile=True), eager)


def test_a_fresh_model_compiles_its_step_once(tmp_path, caplog):
    fresh = tiny_model(tmp_path, "llama")  # never run eagerly: its weights get packed during the first call
    with caplog.at_level(logging.INFO, logger="decodekit"):
        outputs = [fresh.generate(PROMPT, max_new_tokens=6, compile=True) for _ in range(3)]
    assert caplog.text.count("compiling the decode step") == 1 and len(StepHost.of(fresh).steps("fused")) == 1
    assert all(torch.equal(out, fresh.generate(PROMPT, max_new_tokens=6)) for out in outputs)


def test_steps_follow_the_model_through_dtype_moves_and_quantization(tmp_path):
    # The compiled step does not guard the model's weights (argument_guards_only): a changed model
    # must get a new step, and a repacked one must be read afresh.
    from decodekit.kernels.packed import unpack_linears
    from decodekit.kernels.quantize import quantize

    m = tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    kwargs = dict(input_ids=BATCH, attention_mask=MASK, max_new_tokens=12, eos_token_id=[3, 40])
    reference = m.generate(**kwargs)
    assert torch.equal(m.generate(**kwargs, compile=True), reference)
    m.to(torch.bfloat16)
    assert torch.equal(m.generate(**kwargs, compile=True), m.generate(**kwargs))
    m.float()
    unpack_linears(m)
    with torch.no_grad():
        for layer in m.layers:
            layer.mlp.down.weight.mul_(-3.0)  # repacked at the next forward: new objects, new values, same key
    changed = m.generate(**kwargs)
    assert not torch.equal(changed, reference)
    assert torch.equal(m.generate(**kwargs, compile=True), changed)
    quantize(m, "int8")
    assert torch.equal(m.generate(**kwargs, compile=True), m.generate(**kwargs))
    assert len({key[-1] for key in StepHost.of(m).steps("fused")}) == 3  # fp32, bf16, int8


def test_bad_compile_config(model):
    with pytest.raises(ValueError, match=r"compile_config=\{'fast': True\} is invalid"):
        model.generate(PROMPT, max_new_tokens=2, compile_config={"fast": True})
    with pytest.raises(
        ValueError, match=r"compile_config=\{'mode': 'fastest'\} is invalid; mode='fastest' is not one of \['default', "
    ):
        model.generate(PROMPT, max_new_tokens=2, compile_config={"mode": "fastest"})
    with pytest.raises(ValueError, match=r"compile='yes' is invalid"):
        model.generate(PROMPT, max_new_tokens=2, compile="yes")


def test_a_compile_mode_keeps_the_step_options_and_guard_filter(model):
    # torch.compile refuses `mode` together with `options`: for inductor the mode becomes options.
    from decodekit.core.compile import STEP_INDUCTOR_OPTIONS, compile_arguments

    args = compile_arguments({"fullgraph": True, "dynamic": False, "mode": "max-autotune-no-cudagraphs"})
    assert "mode" not in args and args["fullgraph"] is True
    assert args["options"]["max_autotune"] is True and args["options"]["guard_filter_fn"] is argument_guards_only
    assert STEP_INDUCTOR_OPTIONS.items() <= args["options"].items()
    assert compile_arguments({"backend": "eager", "mode": "default"}) == {"backend": "eager", "mode": "default"}
    out = model.generate(PROMPT, max_new_tokens=8, compile_config={"mode": "default"})
    assert torch.equal(out, model.generate(PROMPT, max_new_tokens=8))


def test_compile_config_options_reach_inductor_over_the_step_options_and_bad_ones_are_refused(model):
    from decodekit.core.compile import compile_arguments

    args = compile_arguments({"mode": "default", "options": {"realize_opcount_threshold": 50, "size_asserts": False}})
    assert args["options"]["realize_opcount_threshold"] == 50 and args["options"]["size_asserts"] is False
    assert (
        args["options"]["realize_acc_reads_threshold"] == 3
        and args["options"]["guard_filter_fn"] is argument_guards_only
    )
    out = model.generate(PROMPT, max_new_tokens=8, compile_config={"options": {"size_asserts": False}})
    assert torch.equal(out, model.generate(PROMPT, max_new_tokens=8))
    with pytest.raises(ValueError, match=r"options \['not_an_option'\] are not inductor options"):
        model.generate(PROMPT, max_new_tokens=2, compile_config={"options": {"not_an_option": 1, "size_asserts": True}})
    with pytest.raises(ValueError, match=r"options must be a dict"):
        model.generate(PROMPT, max_new_tokens=2, compile_config={"options": ["size_asserts"]})
    with pytest.raises(ValueError, match=r"mode or options, not both"):
        model.generate(PROMPT, max_new_tokens=2, compile_config={"backend": "eager", "mode": "x", "options": {"a": 1}})


def test_real_model_compiled_equals_eager(default_model):
    model, tok = default_model
    single = tok("The capital of France is", return_tensors="pt")
    batch = tok(["The capital of France is", "Hi", "One, two, three,"], return_tensors="pt", padding=True)
    for enc in (single, batch):
        eager = model.generate(**enc, max_new_tokens=16)
        assert torch.equal(eager, model.generate(**enc, max_new_tokens=16, compile=True))


def test_real_model_int8_compiled_equals_eager(default_model):
    from decodekit import AutoModelForCausalLM
    from decodekit.loading.default import default_model_path

    tok = default_model[1]
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), quantize="int8")  # the C++ stack's int8 path
    enc = tok("The capital of France is", return_tensors="pt")
    eager = model.generate(**enc, max_new_tokens=32)
    assert torch.equal(eager, model.generate(**enc, max_new_tokens=32, compile=True))


def test_a_hub_method_contributing_a_score_only_processor_is_fused(model, tmp_path, caplog):
    from methods import write_method

    method = """
        from decodekit import hookimpl


        class Ban:
            score_only = True  # reads only the scores: the compiled step may run it

            def __init__(self, token):
                self.token = token

            def __call__(self, input_ids, scores):
                return scores.index_fill(-1, torch.tensor([self.token]), -float("inf"))


        import torch


        @hookimpl
        def decodekit_config_fields():
            return {"ban": None}


        @hookimpl
        def decodekit_logits_processors(generation_config):
            return [Ban(generation_config.ban)] if generation_config.ban is not None else []
    """
    repo = write_method(tmp_path / "ban", method)
    banned = int(model.generate(PROMPT, max_new_tokens=1, eos_token_id=None)[0, -1])
    kwargs = dict(custom_generate=str(repo), trust_remote_code=True, max_new_tokens=12, eos_token_id=None, ban=banned)
    eager = model.generate(PROMPT, **kwargs)
    with caplog.at_level(logging.INFO, logger="decodekit"):
        compiled = model.generate(PROMPT, compile=True, **kwargs)
    assert torch.equal(eager, compiled) and banned not in compiled[0, 5:].tolist()
    assert "falls back" not in caplog.text


def test_two_plain_function_processors_never_share_a_compiled_step(model):
    def ban(token):
        def processor(input_ids, scores):
            return scores.index_fill(-1, torch.tensor([token]), -float("inf"))

        processor.score_only = True
        return processor

    first = int(model.generate(PROMPT, max_new_tokens=1, eos_token_id=None)[0, -1])
    second = int(model.generate(PROMPT, max_new_tokens=1, eos_token_id=None, suppress_tokens=[first])[0, -1])
    for token in (first, second):
        kwargs = dict(max_new_tokens=6, eos_token_id=None, logits_processor=[ban(token)])
        out = model.generate(PROMPT, compile=True, **kwargs)
        assert torch.equal(out, model.generate(PROMPT, **kwargs)) and token not in out[0, 5:].tolist()


def test_a_step_that_does_not_compile_falls_back(model, caplog):
    def host_reading(input_ids, scores):
        if float(scores.max()) > 1e9:  # a host read: dynamo cannot keep this in one graph
            return scores * 0
        return scores

    host_reading.score_only = True  # a wrong claim: the step must still not break generation
    kwargs = dict(max_new_tokens=5, eos_token_id=None, logits_processor=[host_reading])
    with caplog.at_level(logging.INFO, logger="decodekit"):
        out = model.generate(PROMPT, compile=True, **kwargs)
    assert torch.equal(out, model.generate(PROMPT, **kwargs))
    assert "falls back to the eager loop: the step did not compile" in caplog.text


@pytest.mark.parametrize(
    "config, graphs",
    [
        ({}, False),
        ({"mode": "default"}, False),
        ({"mode": "reduce-overhead"}, True),
        ({"mode": "max-autotune"}, True),
        ({"mode": "max-autotune-no-cudagraphs"}, False),
        ({"options": {"triton.cudagraphs": True}}, True),
        ({"backend": "cudagraphs"}, True),
        ({"backend": "eager"}, False),
    ],
)
def test_which_compile_configs_replay_cuda_graphs(config, graphs):
    """Those steps mark their cache as a fixed address and copy their outputs out of the graph's memory on CUDA
    (tests/test_cuda.py checks the replay itself on a GPU)."""
    from decodekit.core.compile import replays_graphs

    assert replays_graphs({"fullgraph": True, "dynamic": False, **config}) is graphs


def test_a_step_on_cuda_replays_graphs_unless_compile_config_chooses_otherwise():
    from decodekit.core.compile import replays_graphs, step_options

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert step_options(None, cpu) == {"fullgraph": True, "dynamic": False}
    assert step_options(None, cuda) == {"fullgraph": True, "dynamic": False, "mode": "reduce-overhead"}
    assert replays_graphs(step_options({"fullgraph": False}, cuda))
    for own in (
        {"mode": "default"},
        {"mode": "max-autotune-no-cudagraphs"},
        {"backend": "eager"},
        {"options": {"size_asserts": False}},
    ):
        options = step_options(own, cuda)
        assert "reduce-overhead" not in options.values() and not replays_graphs(options)


def test_the_cpu_instruction_check_is_made_once_per_machine_and_then_read(tmp_path, monkeypatch):
    # inductor builds and loads a test library per vector instruction set at every process's first compile; decodekit
    # records the answer in torch's cache folder, and a later process reads it instead of checking again.
    import platform
    import sys

    from torch._inductor import cpu_vec_isa

    from decodekit.core import compile as steps

    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the record is made on x86-64 Linux only; elsewhere inductor checks as it does")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(steps.cpu_isa_checked, "answer", None)
    checked = steps.cpu_isa_checked()
    (record,) = tmp_path.glob("decodekit-cpu-isa-*")
    assert record.read_text() == ("passed" if checked else "failed")
    assert ("cpp.vec_isa_ok" in steps.compile_arguments({})["options"]) is checked

    def no_check(self):
        raise AssertionError("the check ran again")

    monkeypatch.setattr(cpu_vec_isa.VecISA, "__bool__", no_check)
    monkeypatch.setattr(steps.cpu_isa_checked, "answer", None)  # as a new process starts
    assert steps.cpu_isa_checked() is checked
    record.write_text("failed")  # a machine whose check failed: inductor checks at each compile, as it would
    monkeypatch.setattr(steps.cpu_isa_checked, "answer", None)
    assert steps.cpu_isa_checked() is False and "cpp.vec_isa_ok" not in steps.compile_arguments({})["options"]


def test_a_criterion_the_step_does_not_cover_keeps_the_call_eager_and_is_obeyed(model, caplog):
    # Before: any EosTokenCriteria or MaxLengthCriteria counted as the step's own, whatever its ids or length, so
    # compile=True ran past a caller's stop token or length that the eager loop obeyed.
    from decodekit.core.stopping import EosTokenCriteria, MaxLengthCriteria

    plain = model.generate(PROMPT, max_new_tokens=12, eos_token_id=None)
    stop = int(plain[0, 8])
    for criterion in (EosTokenCriteria(stop), MaxLengthCriteria(PROMPT.shape[1] + 4)):
        kwargs = dict(max_new_tokens=12, eos_token_id=None, stopping_criteria=[criterion])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="decodekit"):
            compiled = model.generate(PROMPT, compile=True, **kwargs)
        assert torch.equal(compiled, model.generate(PROMPT, **kwargs))
        assert compiled.shape[1] < plain.shape[1]
        assert f"the stopping criterion {type(criterion).__name__} needs the host every step" in caplog.text


def test_what_can_fuse_is_read_from_declarations():

    from decodekit.core.config import GenerationConfig
    from decodekit.core.fused_loop import min_length_of, supports_step, unfusable_reason
    from decodekit.core.pipeline import Pipeline, last_position_logits
    from decodekit.core.penalties import MinLengthLogitsProcessor
    from decodekit.core.processors import processor_key
    from decodekit.core.warpers import TopKLogitsWarper
    from decodekit.core.selectors import GreedySelector
    from decodekit.families.llama import LlamaForCausalLM

    class OwnModel:  # a model of someone else's that declares decodekit's fused step
        steps_supported = ("fused",)

    class Banned:  # declares what MinLengthLogitsProcessor does, under another class
        eos, blocks_eos_until = [2], 9

    gc = GenerationConfig(eos_token_id=2)
    pipeline = Pipeline(
        processors=[TopKLogitsWarper(4), Banned()],
        selector=GreedySelector(),
        stopping=[],
        cache=None,
        next_token_logits=last_position_logits,
    )
    assert supports_step(LlamaForCausalLM, "fused") and supports_step(LlamaForCausalLM, "paged")
    assert unfusable_reason(OwnModel(), pipeline, gc) is None and min_length_of(pipeline) == 9
    assert "does not declare a fused step" in unfusable_reason(object(), pipeline, gc)
    pipeline.processors = [MinLengthLogitsProcessor(9, [2, 3])]
    assert "bans other tokens than the call's EOS ids [2]" in unfusable_reason(OwnModel(), pipeline, gc)
    assert (
        processor_key(TopKLogitsWarper(4)) == processor_key(TopKLogitsWarper(4)) != processor_key(TopKLogitsWarper(5))
    )
    function = lambda input_ids, scores: scores  # noqa: E731
    assert processor_key(function) == processor_key(function) != processor_key(lambda input_ids, scores: scores)


def test_a_plugins_traceable_selector_runs_inside_the_step(model, caplog):
    # Before: the fused step drew by argmax for any selector it did not take for sampling, so a plugin's traceable
    # selector was replaced by greedy decoding under compile=True.
    import decodekit
    from decodekit import hookimpl
    from decodekit.core.selectors import Selector

    class Lowest(Selector):
        traceable = True

        def __call__(self, input_ids, scores):
            return scores.argmin(dim=-1)

    class PickLowest:
        @hookimpl
        def decodekit_config_fields(self):
            return {"pick_lowest": False}

        @hookimpl
        def decodekit_token_selector(self, generation_config):
            return Lowest() if generation_config.pick_lowest else None

    decodekit.register(PickLowest(), name="pick-lowest")
    try:
        kwargs = dict(max_new_tokens=6, eos_token_id=None, pick_lowest=True)
        with caplog.at_level(logging.INFO, logger="decodekit"):
            compiled = model.generate(PROMPT, compile=True, **kwargs)
        assert torch.equal(compiled, model.generate(PROMPT, **kwargs))
        assert not torch.equal(compiled, model.generate(PROMPT, max_new_tokens=6, eos_token_id=None))
        assert "a plugin's traceable selector" in caplog.text and "falls back" not in caplog.text
    finally:
        decodekit.unregister("pick-lowest")
