"""Classifier-free guidance, contrastive search and DoLa: hand-computed cases, transformers where it still ships them."""

import math

import pytest
import torch
import torch.nn.functional as F

from decodekit import AutoModelForCausalLM
from decodekit.core.outputs import CausalLMOutput
from decodekit.plugins.dola import candidate_layers, contrast
from decodekit.testing import tiny_model

from helpers import TableModel, write_tiny_model


# --- classifier-free guidance -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = write_tiny_model(tmp_path_factory.mktemp("cfg"))
    return AutoModelForCausalLM.from_pretrained(path), transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize(
    "kwargs", [dict(guidance_scale=1.5), dict(guidance_scale=3.0, negative_prompt_ids=torch.tensor([[8, 8, 11]]))]
)
def test_guidance_matches_transformers(pair, kwargs):
    ours, ref = pair
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    a = ours.generate(ids, max_new_tokens=12, return_dict_in_generate=True, output_scores=True, **kwargs)
    b = ref.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=12,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )
    assert a.sequences.tolist() == b.sequences.tolist()
    torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), atol=1e-4, rtol=1e-4)


def test_guidance_formula_on_a_toy():
    table = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    model = TableModel(table)
    out = model.generate(
        torch.tensor([[1, 3]]),
        max_new_tokens=1,
        guidance_scale=2.0,
        negative_prompt_ids=torch.tensor([[4]]),
        return_dict_in_generate=True,
        output_scores=True,
    )
    cond, uncond = table[3].log_softmax(-1), table[4].log_softmax(-1)
    torch.testing.assert_close(out.scores[0][0], 2.0 * (cond - uncond) + uncond)


def test_guidance_bad_input(pair):
    ours, _ = pair
    with pytest.raises(
        ValueError,
        match=r"negative_prompt_ids must be an integer tensor \[batch or 1, seq\] of token ids, got a torch.int64 tensor of shape \(2,\)",
    ):
        ours.generate(
            torch.tensor([[5, 6]]), guidance_scale=2.0, negative_prompt_ids=torch.tensor([1, 2]), max_new_tokens=2
        )
    with pytest.raises(ValueError, match="guidance_scale=-1"):
        ours.generate(torch.tensor([[5, 6]]), guidance_scale=-1, max_new_tokens=2)


# --- contrastive search ----------------------------------------------------------------------------------


class OneHotModel(TableModel):
    """logits = table[last token]; last hidden state = one-hot of the token. So a candidate's degeneration
    penalty is 1 if the token is already in the text and 0 otherwise: the answer can be worked out by hand."""

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=True,
        output_hidden_states=False,
    ):
        hidden = F.one_hot(input_ids, self.table.shape[0]).float()
        return CausalLMOutput(
            logits=self.table[input_ids], past_key_values=past_key_values, hidden_states=(hidden, hidden)
        )


def by_hand(table, prompt, steps, k, alpha):
    seq = list(prompt)
    for _ in range(steps):
        p = table[seq[-1]].softmax(-1)
        top = p.topk(k)
        scores = [
            (1 - alpha) * pr.item() - alpha * (1.0 if tok in seq else 0.0)
            for pr, tok in zip(top.values, top.indices.tolist())
        ]
        seq.append(top.indices[max(range(k), key=lambda i: scores[i])].item())
    return seq


def test_contrastive_search_by_hand():
    V = 7
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(5)) * 2
    table[:, 2] += 3.0  # a token every step wants: greedy repeats it, contrastive search avoids it once seen
    model = OneHotModel(table)
    out = model.generate(torch.tensor([[1, 4]]), penalty_alpha=0.6, top_k=3, max_new_tokens=6)[0].tolist()
    assert out == by_hand(table, [1, 4], 6, 3, 0.6)
    greedy = model.generate(torch.tensor([[1, 4]]), max_new_tokens=6)[0].tolist()
    assert greedy.count(2) > out.count(2)


def test_contrastive_padded_batch_equals_single_rows(tmp_path):
    model = tiny_model(tmp_path)
    ids = torch.tensor([[5, 9, 14, 3, 7], [0, 0, 4, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    batch = model.generate(ids, attention_mask=mask, penalty_alpha=0.6, top_k=4, max_new_tokens=8, eos_token_id=None)
    one = model.generate(ids[:1], penalty_alpha=0.6, top_k=4, max_new_tokens=8, eos_token_id=None)
    two = model.generate(ids[1:, 2:], penalty_alpha=0.6, top_k=4, max_new_tokens=8, eos_token_id=None)
    assert batch[0].tolist() == one[0].tolist() and batch[1, 2:].tolist() == two[0].tolist()


def test_contrastive_bad_input():
    model = OneHotModel(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="penalty_alpha=0.6 needs top_k > 1"):
        model.generate(torch.tensor([[1]]), penalty_alpha=0.6, top_k=1, max_new_tokens=2)
    with pytest.raises(ValueError, match="penalty_alpha=1.5 is invalid"):
        model.generate(torch.tensor([[1]]), penalty_alpha=1.5, top_k=3, max_new_tokens=2)


# --- DoLa ------------------------------------------------------------------------------------------------


def test_candidate_layers_follow_the_spec():
    assert candidate_layers("low", 12, tied=False) == [0, 2, 4]
    assert candidate_layers("low", 12, tied=True) == [2, 4]  # layer 0 (the embeddings) skipped when tied
    assert candidate_layers("high", 12, tied=False) == [6, 8, 10]
    assert candidate_layers("high", 60, tied=False) == list(range(40, 60, 2))
    assert candidate_layers("low", 60, tied=False) == list(range(0, 20, 2))
    assert candidate_layers("low", 4, tied=True) == [2]
    assert candidate_layers([1, 3], 12, tied=False) == [1, 3]


def test_contrast_by_hand():
    final = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    near = torch.tensor([[1.9, 1.1, 0.4, -2.9]])  # close to the final layer
    far = torch.tensor([[0.0, 2.0, 0.0, 0.0]])  # far from it: DoLa must pick this one
    p = final.softmax(-1)

    def js(q):
        m = 0.5 * (p + q.softmax(-1))
        kl = lambda a: (m * (m.log() - a.log_softmax(-1))).mean()  # noqa: E731  (the reference averages over the vocabulary)
        return 0.5 * (kl(final) + kl(q))

    assert js(far) > js(near)
    out = contrast(final, {3: near, 5: far})
    logp, logq = final.log_softmax(-1), far.log_softmax(-1)
    keep = logp >= logp.max() + math.log(0.1)  # within a factor 0.1 of the top token
    expected = torch.where(keep, logp - logq, torch.tensor(-math.inf))
    torch.testing.assert_close(out, expected)


def test_dola_generation_uses_the_contrast(tmp_path):
    model = tiny_model(tmp_path, num_hidden_layers=4)
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    out = model.generate(ids, dola_layers=[1], max_new_tokens=1, repetition_penalty=1.0)
    with torch.no_grad():
        o = model(ids, output_hidden_states=True)
    premature = model.get_output_embeddings()(o.hidden_states[1][:, -1])
    assert out[0, -1].item() == contrast(o.logits[:, -1], {1: premature}).argmax().item()
    plain = model.generate(ids, max_new_tokens=8)
    dola = model.generate(ids, dola_layers="high", max_new_tokens=8, repetition_penalty=1.2)
    assert dola.shape == plain.shape


@pytest.mark.parametrize(
    "layers, message",
    [
        ([0, 9], r"dola_layers=\[0, 9\] is invalid; .* each in \[0, 4\)"),
        ("middle", r"dola_layers='middle' is invalid"),
        ([], r"dola_layers=\[\] is invalid"),
    ],
)
def test_dola_bad_layers(tmp_path, layers, message):
    model = tiny_model(tmp_path, num_hidden_layers=4)
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[5, 6]]), dola_layers=layers, max_new_tokens=2)
