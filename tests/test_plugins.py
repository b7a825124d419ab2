"""Strategies are pluggy plugins: built-ins are registered like outside ones, and an outside plugin
can add a processor, replace the selector, add a stopping rule, supply a cache and declare config fields."""

import re

import pytest
import torch

import decodekit
from decodekit import DynamicCache, hookimpl
from decodekit.core.selectors import GreedySelector
from decodekit.registry import get_plugin_manager

from helpers import PATIENCE, TableModel

V = 8


def model():
    table = torch.zeros(V, V)
    table[:, 5] = 3.0  # token 5 always wins greedily
    table[:, 6] = 2.0
    return TableModel(table)


def test_builtins_are_registered_plugins():
    names = {name for name, _ in get_plugin_manager().list_name_plugin()}
    assert {"processors", "stopping", "caches", "greedy", "sampling"} <= names


class BanFive:
    """An outside plugin: a processor that bans token 5 unless told otherwise, and a config field."""

    @hookimpl
    def decodekit_config_fields(self):
        return {"ban_five": True}

    @hookimpl
    def decodekit_validate_config(self, generation_config):
        if not isinstance(generation_config.ban_five, bool):
            raise ValueError(f"ban_five={generation_config.ban_five!r} is invalid; expected True or False.")

    @hookimpl
    def decodekit_logits_processors(self, generation_config):
        if not generation_config.ban_five:
            return []

        def ban(input_ids, scores):
            scores[:, 5] = -float("inf")
            return scores

        return [ban]


class LowestSelector:
    @hookimpl
    def decodekit_token_selector(self, generation_config):
        return (
            (lambda input_ids, scores: scores.argmin(dim=-1))
            if getattr(generation_config, "pick_lowest", False)
            else None
        )

    @hookimpl
    def decodekit_config_fields(self):
        return {"pick_lowest": False}


class StopAfterSix:
    @hookimpl
    def decodekit_stopping_criteria(self):
        return [lambda input_ids, scores: input_ids[:, -1] == 6]


class CountingCache:
    made = 0

    @hookimpl
    def decodekit_cache(self, context):
        CountingCache.made += 1
        assert context.batch_size == 1 and context.max_length == 5
        return DynamicCache()


@pytest.fixture
def registered():
    names = []

    def add(plugin, name):
        decodekit.register(plugin, name=name)
        names.append(name)

    yield add
    for name in names:
        decodekit.unregister(name)


def test_processor_and_config_field(registered):
    m = model()
    prompt = torch.tensor([[1]])
    assert m.generate(prompt, max_new_tokens=2).tolist() == [[1, 5, 5]]
    registered(BanFive(), "ban-five")
    assert m.generate(prompt, max_new_tokens=2).tolist() == [[1, 6, 6]]
    assert m.generate(prompt, max_new_tokens=2, ban_five=False).tolist() == [[1, 5, 5]]
    with pytest.raises(ValueError, match="ban_five='no'"):
        m.generate(prompt, max_new_tokens=2, ban_five="no")


def test_selector_override_only_when_asked(registered):
    registered(LowestSelector(), "lowest")
    m = model()
    assert m.generate(torch.tensor([[1]]), max_new_tokens=1).tolist() == [[1, 5]]
    assert m.generate(torch.tensor([[1]]), max_new_tokens=1, pick_lowest=True).tolist() == [[1, 0]]


def test_stopping_rule_and_cache(registered):
    registered(BanFive(), "ban-five")
    registered(StopAfterSix(), "stop-six")
    registered(CountingCache(), "counting-cache")
    out = model().generate(torch.tensor([[1]]), max_new_tokens=4, return_dict_in_generate=True)
    assert out.sequences.tolist() == [[1, 6]]
    assert CountingCache.made == 1 and isinstance(out.past_key_values, DynamicCache)


def test_hooks_called_once_per_generate_not_per_token(registered):
    calls = []

    class Spy:
        @hookimpl
        def decodekit_logits_processors(self):
            calls.append(1)
            return []

    registered(Spy(), "spy")
    model().generate(torch.tensor([[1]]), max_new_tokens=6)
    assert calls == [1]


def test_user_lists_and_dict_output():
    m = model()
    out = m.generate(
        torch.tensor([[1]]),
        max_new_tokens=3,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        logits_processor=[lambda ids, s: s.index_fill(-1, torch.tensor([5]), -float("inf"))],
        stopping_criteria=[lambda ids, s: torch.full((ids.shape[0],), ids.shape[1] >= 3)],
    )
    assert out.sequences.tolist() == [[1, 6, 6]]
    assert len(out.scores) == len(out.logits) == 2
    assert out.logits[0][0, 5] == 3.0 and out.scores[0][0, 5] == -float("inf")
    assert out["sequences"] is out.sequences and "scores" in out.keys()


def test_unregister_unknown_name():
    with pytest.raises(ValueError, match="No plugin named 'nope'"):
        decodekit.unregister("nope")


def test_no_selector_is_a_clear_error():
    from decodekit.registry.manager import reset

    decodekit.unregister("greedy")
    try:
        with pytest.raises(ValueError, match="No registered plugin selects tokens"):
            model().generate(torch.tensor([[1]]), max_new_tokens=1)
    finally:
        reset()  # the built-ins as they were
    assert get_plugin_manager().get_plugin("greedy") is not None
    assert isinstance(GreedySelector()(None, torch.tensor([[0.0, 1.0]])), torch.Tensor)


def test_trace_shows_each_hook_call_and_who_answered(tmp_path, monkeypatch, capsys):
    """DECODEKIT_TRACE=1 and --trace write every hook call, through pluggy's monitoring (so calls go through pluggy)."""
    import subprocess
    import sys

    from decodekit.registry.manager import PluginHost, use_host
    from decodekit.testing import write_tiny_model

    m = decodekit.AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "m"))
    monkeypatch.setenv("DECODEKIT_TRACE", "1")
    with use_host(PluginHost(installed=False)):  # a host made now, with the variable set
        m.generate(torch.tensor([[1, 2]]), max_new_tokens=2, do_sample=True, top_k=5, seed=0)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("decodekit trace:")]
    assert any(
        line.startswith("decodekit trace: decodekit_token_selector -> ") and "sampling" in line for line in lines
    )
    assert "decodekit trace: decodekit_token_selector answered by ['sampling']" in lines
    assert any("decodekit_logits_processors answered by" in line and "'processors'" in line for line in lines), lines
    cli = subprocess.run(
        [sys.executable, "-m", "decodekit.cli", "--trace", "list"], capture_output=True, text=True, timeout=PATIENCE
    )
    assert cli.returncode == 0 and "decodekit trace: decodekit_config_fields answered by [" in cli.stderr


class Marker:
    """A processor that changes nothing; `stage` as it declares one (None: it declares none)."""

    def __init__(self, name, stage=None):
        self.__name__ = name
        if stage is not None:
            self.stage = stage

    def __call__(self, input_ids, scores):
        return scores


def staged_plugin(*markers):
    class Staged:
        @hookimpl
        def decodekit_logits_processors(self):
            return list(markers)

    return Staged()


def processors_run(m, **kwargs):
    """The processors an eager generate() call applies, in order: (name, owner)."""
    from decodekit.core.processors import observe_processors

    seen = []

    def observer(description, before, after):
        name, _, owner = description.removeprefix("the logits processor ").partition(" of ")
        if (name, owner) not in seen:
            seen.append((name, owner))

    with observe_processors(observer):
        m.generate(torch.tensor([[1]]), max_new_tokens=1, **kwargs)
    return seen


def test_processors_run_by_declared_stage_then_by_registration(registered):
    # Before: pluggy's order (tryfirst built-ins, then the newest outside plugin first, then llama.cpp's chain and the
    # watermark), which put an outside processor after the sampling warpers though the hookspec said otherwise.
    registered(staged_plugin(Marker("early"), Marker("early_post", stage="post")), "early")
    registered(staged_plugin(Marker("late"), Marker("late_mask", stage="constraints")), "late")
    order = processors_run(
        model(),
        do_sample=True,
        temperature=0.7,
        top_k=4,
        repetition_penalty=1.2,
        watermarking_config={"greenlist_ratio": 0.5},
        renormalize_logits=True,
        logits_processor=[Marker("given")],
        seed=0,
    )
    assert order == [
        ("late_mask", "plugin 'late'"),  # constraints
        ("RepetitionPenaltyLogitsProcessor", "plugin 'processors'"),  # penalties: built-ins first,
        ("early", "plugin 'early'"),  # then outside plugins in registration order (a processor declaring no stage),
        ("late", "plugin 'late'"),
        ("given", "logits_processor (passed to generate)"),  # then generate()'s own, where transformers puts them
        ("TemperatureLogitsWarper", "plugin 'processors'"),  # samplers, in transformers' warper order
        ("TopKLogitsWarper", "plugin 'processors'"),
        ("WatermarkLogitsProcessor", "plugin 'watermark'"),  # post
        ("early_post", "plugin 'early'"),
        ("LogitNormalization", "plugin 'processors'"),  # final
    ]


def test_an_outside_processor_runs_before_llama_cpps_chain(registered):
    registered(staged_plugin(Marker("outside")), "outside")
    order = processors_run(model(), do_sample=True, top_k=4, dry_multiplier=0.8, dry_sequence_breakers=[], seed=0)
    assert [name for name, _ in order] == ["outside", "DRYLogitsProcessor", "TopKLogitsWarper"]


class RaisingStage(Marker):
    @property
    def stage(self):
        raise RuntimeError("no stage here")


@pytest.mark.parametrize(
    "marker,words",
    [(Marker("lost", stage="sideways"), r"stage='sideways'.*'guidance'"), (RaisingStage("lost"), "no stage here")],
    ids=["unknown stage", "stage raises"],
)
def test_a_processor_whose_declarations_cannot_be_read_is_its_plugins_failure(registered, marker, words):
    # As a hook that raises: the plugin is disabled, named, and the call goes on without it. Before: an unknown stage
    # failed that first call, and a stage property that raised failed every later call with a bare RuntimeError.
    from decodekit.registry.manager import plugin_records

    registered(staged_plugin(marker), "lost")
    for _ in range(2):
        assert model().generate(torch.tensor([[1]]), max_new_tokens=1).tolist() == [[1, 5]]
    assert get_plugin_manager().get_plugin("lost") is None  # disabled, as a processor that raises is
    record = {r.name: r for r in plugin_records()}["lost"]
    assert re.search(r"the logits processor lost of plugin 'lost'.*" + words, record.error), record.error


def test_a_processor_passed_to_generate_with_an_unreadable_stage_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="logits_processor: .*no stage here"):
        model().generate(torch.tensor([[1]]), max_new_tokens=1, logits_processor=[RaisingStage("given")])


def test_a_fresh_host_keeps_its_plugins_to_itself():
    from decodekit.registry.manager import PluginHost, use_host

    with use_host(PluginHost(installed=False)) as host:
        decodekit.register(BanFive(), name="ban-five")
        assert host.pm.get_plugin("ban-five") is not None
        assert model().generate(torch.tensor([[1]]), max_new_tokens=2).tolist() == [[1, 6, 6]]
    assert get_plugin_manager().get_plugin("ban-five") is None
    assert model().generate(torch.tensor([[1]]), max_new_tokens=2).tolist() == [[1, 5, 5]]
