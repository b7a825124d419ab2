"""Builders shared by the tests: a table-driven toy model and chi-square helpers (tiny checkpoints live in decodekit.testing)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from decodekit.core.config import GenerationConfig
from decodekit.core.generate import GenerationMixin
from decodekit.core.outputs import CausalLMOutput
from decodekit.kernels.quantize import int_mm_exact
from decodekit.testing import tiny_config, tiny_state_dict, write_tiny_model  # noqa: F401  (re-exported for the tests)

# How long a test waits for another thread or process (a server's answer, a result, a subprocess) before calling it
# hung. Far above what any wait takes on a loaded machine: tests bound work by counting it, never by timing it, and
# this bound is reached only by a hang (DECODEKIT_TEST_PATIENCE changes it).
PATIENCE = float(os.environ.get("DECODEKIT_TEST_PATIENCE", 600))

# torch._int_mm sums pairs in 16 bits where oneDNN is held below VNNI on a VNNI CPU (ONEDNN_MAX_CPU_ISA=AVX2, as
# docs/performance.md holds an AVX-512 machine to an AVX2-only one's paths): the int8_split route is then wrong, and
# decodekit does not offer it (quantize.int_mm_exact); tests that force it are skipped there.
needs_exact_int_mm = pytest.mark.skipif(
    not int_mm_exact(),
    reason="torch._int_mm's sums are not exact in this process (oneDNN held below VNNI: ONEDNN_MAX_CPU_ISA)",
)


class TableModel(GenerationMixin, nn.Module):
    """A toy model whose next-token logits depend only on the last token: logits = table[last_token].

    Its next-token distribution is known exactly, which is what sampling tests need.
    """

    def __init__(self, table: torch.Tensor, eos_token_id=None, pad_token_id=None):
        super().__init__()
        self.table = nn.Parameter(table.float(), requires_grad=False)
        self.config = SimpleNamespace(vocab_size=table.shape[0], eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        self.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=pad_token_id)

    @property
    def device(self):
        return self.table.device

    @property
    def dtype(self):
        return self.table.dtype

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True):
        return CausalLMOutput(logits=self.table[input_ids], past_key_values=past_key_values)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the tokens with nonzero expected probability, and its degrees of freedom.
    A sample landing on a zero-probability token makes the statistic infinite."""
    n = counts.sum().item()
    support = probs > 0
    if counts[~support].sum() > 0:
        return math.inf, int(support.sum()) - 1
    expected = probs[support] * n
    stat = (((counts[support] - expected) ** 2) / expected).sum().item()
    return stat, int(support.sum()) - 1


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) by the Wilson-Hilferty approximation; z=3.719 is p = 1e-4."""
    if df <= 0:
        return 0.0
    a = 2.0 / (9.0 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def assert_continuous_batching_gives_each_alone(model, prompts, oracle=None, max_new_tokens=6):
    """Greedy requests for `prompts` through `model`'s continuous batching finish with the tokens `oracle` (default:
    the model itself) gives each prompt alone through generate."""
    from decodekit.batching import RequestStatus

    manager = model.init_continuous_batching(block_size=4)
    ids = [manager.add_request(p, max_new_tokens=max_new_tokens, do_sample=False) for p in prompts]
    manager.run(until_idle=True)
    for prompt_ids, rid in zip(prompts, ids):
        out = manager.get_result(rid, timeout=0)
        assert out.status == RequestStatus.FINISHED, out.error
        alone = (oracle or model).generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
        assert out.sequences[0] == alone[0, len(prompt_ids) :].tolist()[: len(out.sequences[0])]
