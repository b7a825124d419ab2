"""generate() keeps its loops clear of CPython frame-stack chunk boundaries (decodekit/core/stack.py)."""

import sys

import pytest
import torch

from decodekit.core.stack import stack_room
from decodekit.testing import tiny_model

PROMPT = torch.tensor([[5, 9, 14, 3, 7]])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("stack"), "mistral")


@pytest.mark.skipif(sys.platform != "linux", reason="counts minor page faults through getrusage")
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_decoding_faults_no_pages_per_token_at_any_call_depth(model, compile):
    """Without stack room, some call depths put a chunk boundary inside the per-token calls: the chunk is
    opened and freed, a page fault, on every call (here ~15-30 a token eager, ~15 compiled; on the default
    model compiled, ~150 a token and a quarter of its time)."""
    import resource

    def nested(depth, fn):
        return fn() if depth == 0 else nested(depth - 1, fn)

    tokens = 60
    kwargs = dict(max_new_tokens=tokens, compile=compile, eos_token_id=None)
    model.generate(PROMPT, **kwargs)
    worst = 0
    for depth in range(0, 330, 5):  # ~100 bytes a frame: the sweep crosses more than one 16 KiB chunk
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        nested(depth, lambda: model.generate(PROMPT, **kwargs))
        worst = max(worst, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # A call may fault a few pages once (the new chunk, the call's own allocations), never a few per token.
    assert worst < 4 * tokens


def test_stack_room_passes_arguments_results_and_errors_through():
    @stack_room
    def f(a, *, b):
        """doc"""
        if b is None:
            raise KeyError("b")
        return a + b

    assert f(2, b=3) == 5 and f.__name__ == "f" and f.__doc__ == "doc"
    with pytest.raises(KeyError):
        f(1, b=None)
    assert stack_room(stack_room(lambda: "nested"))() == "nested"
