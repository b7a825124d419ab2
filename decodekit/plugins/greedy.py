"""Greedy decoding: the highest-scoring token each step (do_sample=False)."""

from ..core.selectors import GreedySelector
from ..registry import hookimpl


@hookimpl
def decodekit_config_fields():
    return {"do_sample": False}


@hookimpl
def decodekit_token_selector(generation_config, context):
    return None if generation_config.do_sample else GreedySelector()
