"""Assisted decoding and prompt lookup: greedy output identical to plain greedy, sampling keeps the target's
distribution, clear errors."""

import pytest
import torch

from decodekit.plugins.speculative import prompt_lookup_candidates
from decodekit.testing import tiny_model

from helpers import TableModel, chi_square, chi_square_critical


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return tiny_model(d / "t", seed=0), tiny_model(d / "a", seed=1)


def prompts(n=12):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(3, 96, (1, 7), generator=g)
        yield torch.cat([ids, ids[:, :4], ids], dim=1)  # repeats, so prompt lookup finds matches


@pytest.mark.parametrize("mode", ["other assistant", "assistant is the target", "prompt lookup", "heuristic schedule"])
def test_greedy_output_is_identical_to_plain_greedy(models, mode):
    target, other = models
    extra = {
        "other assistant": dict(assistant_model=other, num_assistant_tokens=4),
        "assistant is the target": dict(assistant_model=target, num_assistant_tokens=5),  # every candidate accepted
        "prompt lookup": dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3),
        "heuristic schedule": dict(
            assistant_model=other, num_assistant_tokens=3, num_assistant_tokens_schedule="heuristic"
        ),
    }[mode]
    for ids in prompts():
        for eos in (None, 2):
            plain = target.generate(ids, max_new_tokens=16, eos_token_id=eos)
            fast = target.generate(ids, max_new_tokens=16, eos_token_id=eos, **extra)
            assert torch.equal(plain, fast)


def test_every_candidate_rejected_still_gives_greedy():
    V = 8
    target_table = torch.randn(V, V, generator=torch.Generator().manual_seed(2))
    target = TableModel(target_table)
    contrarian = TableModel(-target_table)  # always proposes the target's least likely token
    ids = torch.tensor([[1, 4, 6]])
    plain = target.generate(ids, max_new_tokens=12)
    assert torch.equal(
        target.generate(ids, max_new_tokens=12, assistant_model=contrarian, num_assistant_tokens=3), plain
    )


def test_prompt_lookup_candidates():
    ids = torch.tensor([5, 6, 7, 8, 9, 5, 6])
    assert prompt_lookup_candidates(ids, 2, 3, room=10).tolist() == [7, 8, 9]  # "5 6" seen before: continue it
    assert prompt_lookup_candidates(ids, 2, 3, room=2).tolist() == [7, 8]
    assert prompt_lookup_candidates(torch.tensor([1, 2, 3]), 2, 3, room=10).tolist() == []  # nothing to match
    assert prompt_lookup_candidates(torch.tensor([4, 1, 2, 9, 2]), 3, 2, room=10).tolist() == [
        9,
        2,
    ]  # falls back to n=1


def first_two_tokens(target, n, **kwargs):
    g = torch.Generator().manual_seed(42)
    rows = [
        target.generate(torch.tensor([[3]]), max_new_tokens=2, do_sample=True, top_k=0, generator=g, **kwargs)[0, 1:]
        for _ in range(n)
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("source", ["assistant", "prompt lookup"])
def test_speculative_sampling_keeps_the_target_distribution(source):
    V = 6
    g = torch.Generator().manual_seed(7)
    target_table = torch.randn(V, V, generator=g)
    target = TableModel(target_table)
    if source == "assistant":
        kwargs = dict(assistant_model=TableModel(torch.randn(V, V, generator=g) * 2), num_assistant_tokens=2)
    else:
        target_table[3] += (
            torch.nn.functional.one_hot(torch.tensor(3), V) * 1.5
        )  # make 3 -> 3 repeats (lookup hits) common
        kwargs = dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=1)
    assert_first_two_tokens_follow(target_table, first_two_tokens(target, 2500, **kwargs))


def assert_first_two_tokens_follow(target_table, samples):
    """The first sampled token (after token 3) and the second (after the most common first) follow the target's
    distributions: a chi-square test each."""
    V = target_table.shape[0]
    stat, df = chi_square(torch.bincount(samples[:, 0], minlength=V).float(), torch.softmax(target_table[3], -1))
    assert stat < chi_square_critical(df), (stat, df)
    common = int(samples[:, 0].mode().values)
    second = torch.bincount(samples[samples[:, 0] == common, 1], minlength=V).float()
    stat, df = chi_square(second, torch.softmax(target_table[common], -1))
    assert stat < chi_square_critical(df), (stat, df)


def test_bad_arguments(models):
    target, other = models
    ids = torch.tensor([[5, 6, 7]])
    small = TableModel(torch.zeros(10, 10))
    with pytest.raises(ValueError, match="assistant_model has a vocabulary of 10 tokens, the model 96"):
        target.generate(ids, assistant_model=small, max_new_tokens=2)
    with pytest.raises(ValueError, match="one prompt at a time; got batch size 2"):
        target.generate(ids.repeat(2, 1), assistant_model=other, max_new_tokens=2)
    with pytest.raises(ValueError, match="not both"):
        target.generate(ids, assistant_model=other, prompt_lookup_num_tokens=3, max_new_tokens=2)
    with pytest.raises(ValueError, match="not beam search"):
        target.generate(ids, assistant_model=other, num_beams=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=0"):
        target.generate(ids, prompt_lookup_num_tokens=0, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule='sometimes'"):
        target.generate(ids, assistant_model=other, num_assistant_tokens_schedule="sometimes", max_new_tokens=2)
    for field in ("num_assistant_tokens", "max_matching_ngram_size"):  # a bool is not a count
        with pytest.raises(ValueError, match=f"{field}=True"):
            target.generate(ids, assistant_model=other, max_new_tokens=2, **{field: True})


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("deep"), num_hidden_layers=4, seed=3)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_self_speculative_greedy_is_plain_greedy(deep, layers):
    for ids in prompts():
        plain = deep.generate(ids, max_new_tokens=16, eos_token_id=None)
        assert torch.equal(deep.generate(ids, max_new_tokens=16, eos_token_id=None, assistant_early_exit=layers), plain)


def test_the_draft_reuses_the_targets_cache(deep, monkeypatch):
    # The draft's layers are the target's first ones, so it drafts on the target's cache: it never feeds the
    # prompt or the tokens the target accepted again, one token per draft forward; the output stays plain greedy.
    import functools

    fed = []
    forward = type(deep.module).forward

    @functools.wraps(forward)  # keeps the signature, which tells the draft it may pass exit_layer
    def spy(self, input_ids, *args, **kwargs):
        fed.append((kwargs.get("exit_layer"), input_ids.shape[1]))
        return forward(self, input_ids, *args, **kwargs)

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    plain = deep.generate(ids, max_new_tokens=12, eos_token_id=None)
    monkeypatch.setattr(type(deep.module), "forward", spy)
    assert torch.equal(deep.generate(ids, max_new_tokens=12, eos_token_id=None, assistant_early_exit=2), plain)
    drafts = [length for layers, length in fed if layers == 2]
    assert drafts and set(drafts) == {1}


def test_the_early_exit_draft_runs_only_its_layers(deep):
    from decodekit.plugins.speculative import EarlyExit

    ids = torch.tensor([[5, 6, 7, 8]])
    two = deep(ids, exit_layer=2, use_cache=False).logits
    assert torch.equal(EarlyExit(deep, 2)(ids, use_cache=False).logits, two)
    assert not torch.allclose(two, deep(ids, use_cache=False).logits)
    hidden = deep(ids, use_cache=False, output_hidden_states=True).hidden_states[2]
    torch.testing.assert_close(two, deep.lm_head(deep.norm(hidden)))  # layers 0-1, then the final norm and head


def test_self_speculative_sampling_keeps_the_target_distribution(deep):
    ids = torch.tensor([[5, 6, 7, 8]])
    scores = deep(ids, use_cache=False).logits[0, -1].float()
    top = scores.topk(5)
    probs = torch.zeros_like(scores).index_put_((top.indices,), torch.softmax(top.values, -1))
    g = torch.Generator().manual_seed(5)
    firsts = [
        int(
            deep.generate(
                ids,
                max_new_tokens=2,
                do_sample=True,
                top_k=5,
                generator=g,
                eos_token_id=None,
                assistant_early_exit=1,
                num_assistant_tokens=1,
            )[0, 4]
        )
        for _ in range(1500)
    ]
    stat, df = chi_square(torch.bincount(torch.tensor(firsts), minlength=scores.shape[0]).float(), probs)
    assert stat < chi_square_critical(df), (stat, df)


def test_early_exit_errors(deep, models):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"assistant_early_exit=4 is invalid; expected an integer in \[1, 4\)"):
        deep.generate(ids, assistant_early_exit=4, max_new_tokens=2)
    with pytest.raises(ValueError, match="drafts with the model itself"):
        deep.generate(ids, assistant_early_exit=1, prompt_lookup_num_tokens=2, max_new_tokens=2)


# ---- universal assisted decoding: an assistant with a vocabulary of its own ----

CHARS = " abcdefghijklmnopqrstuvwxyz.,"


def char_tokenizer(chars: str, extra: int = 0):
    """A character tokenizer: token i is chars[i], then `extra` tokens no text maps to."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

    from decodekit.loading.tokenizer import Tokenizer

    vocab = {c: i for i, c in enumerate(chars)} | {f"<x{j}>": len(chars) + j for j in range(extra)}
    backend = Backend(models.WordLevel(vocab, unk_token=chars[0]))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    return Tokenizer(backend)


@pytest.fixture(scope="module")
def translated(tmp_path_factory):
    """(target, its tokenizer, assistant, its tokenizer): the assistant is the target with its vocabulary
    reordered and three tokens added, so it predicts what the target predicts, in other token ids."""
    from safetensors.torch import load_file, save_file

    from decodekit import AutoModelForCausalLM
    from decodekit.testing import write_tiny_model

    d = tmp_path_factory.mktemp("uad")
    order = torch.randperm(len(CHARS), generator=torch.Generator().manual_seed(5))
    target_path = write_tiny_model(d / "target", vocab_size=len(CHARS), eos_token_id=None, seed=4)
    assistant_path = write_tiny_model(d / "assistant", vocab_size=len(CHARS) + 3, eos_token_id=None, seed=4)
    weights = load_file(str(target_path / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = weights[name][order]  # assistant token k is the target's token order[k]
        weights[name] = torch.cat((rows, torch.zeros(3, rows.shape[1])))
    save_file(weights, str(assistant_path / "model.safetensors"))
    target, assistant = (
        AutoModelForCausalLM.from_pretrained(target_path),
        AutoModelForCausalLM.from_pretrained(assistant_path),
    )
    for model in (target, assistant):
        model.generation_config.eos_token_id = None
    return target, char_tokenizer(CHARS), assistant, char_tokenizer("".join(CHARS[i] for i in order), extra=3)


def char_prompts(tok, n=12):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        yield torch.tensor([tok.encode("".join(CHARS[i] for i in torch.randint(1, len(CHARS), (6,), generator=g)))])


def test_universal_assisted_greedy_is_plain_greedy_and_drafts_are_kept(translated):
    target, tok, assistant, assistant_tok = translated
    forwards = []
    target.register_forward_hook(lambda module, args, out: forwards.append(1))
    for ids in char_prompts(tok):
        plain = target.generate(ids, max_new_tokens=16)
        forwards.clear()
        assisted = target.generate(
            ids,
            max_new_tokens=16,
            assistant_model=assistant,
            tokenizer=tok,
            assistant_tokenizer=assistant_tok,
            num_assistant_tokens=5,
        )
        assert torch.equal(assisted, plain)
        assert len(forwards) <= 6  # the prompt, then about one forward per 5 accepted tokens, not 16


def test_universal_assisted_decoding_with_unrelated_vocabularies(translated, tmp_path):
    # A random assistant of another vocabulary: its drafts are mostly rejected, the output is still the target's.
    target, tok, _, _ = translated
    other_tok = char_tokenizer(CHARS[::-1] + "0123456789", extra=1)
    assistants = [tiny_model(tmp_path, vocab_size=40, seed=9)]
    transformers = pytest.importorskip("transformers")
    import decodekit

    torch.manual_seed(0)
    assistants.append(
        decodekit.wrap(
            transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    vocab_size=40,
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                )
            ).eval()
        )
    )  # a transformers assistant, through its own DynamicCache
    for other in assistants:
        for ids in char_prompts(tok, 4):
            plain = target.generate(ids, max_new_tokens=12)
            assert torch.equal(
                target.generate(
                    ids, max_new_tokens=12, assistant_model=other, tokenizer=tok, assistant_tokenizer=other_tok
                ),
                plain,
            )


def test_universal_assisted_sampling_keeps_the_target_distribution():
    V = 6
    g = torch.Generator().manual_seed(11)
    target_table = torch.randn(V, V, generator=g)
    target, assistant = TableModel(target_table), TableModel(torch.randn(V + 2, V + 2, generator=g) * 2)
    kwargs = dict(
        assistant_model=assistant,
        num_assistant_tokens=2,
        tokenizer=char_tokenizer("abcdef"),
        assistant_tokenizer=char_tokenizer("fedcba", extra=2),
    )
    assert_first_two_tokens_follow(target_table, first_two_tokens(target, 2500, **kwargs))


def test_universal_assisted_decoding_errors(translated):
    target, tok, assistant, assistant_tok = translated
    ids = torch.tensor([tok.encode("abc")])
    with pytest.raises(ValueError, match=r"pass the two tokenizers \(tokenizer= and assistant_tokenizer=\)"):
        target.generate(ids, assistant_model=assistant, max_new_tokens=2)
    with pytest.raises(ValueError, match="needs the model's own tokenizer too: pass tokenizer="):
        target.generate(ids, assistant_model=assistant, assistant_tokenizer=assistant_tok, max_new_tokens=2)
    with pytest.raises(
        ValueError, match="assistant_tokenizer is the tokenizer of assistant_model; pass assistant_model"
    ):
        target.generate(ids, assistant_tokenizer=assistant_tok, tokenizer=tok, max_new_tokens=2)
    with pytest.raises(ValueError, match="assistant_tokenizer must be a tokenizer with encode"):
        target.generate(ids, assistant_model=assistant, assistant_tokenizer="gpt2", tokenizer=tok, max_new_tokens=2)
