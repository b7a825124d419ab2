"""Multinomial sampling (do_sample=True), reproducible with generate(seed=...) or generator=."""

from ..core.selectors import SamplingSelector
from ..registry import hookimpl


@hookimpl
def decodekit_config_fields():
    return {"do_sample": False}


@hookimpl
def decodekit_token_selector(generation_config, context):
    return SamplingSelector(context.generator) if generation_config.do_sample else None
