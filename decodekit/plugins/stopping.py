"""Built-in stopping criteria: max length, EOS ids, stop strings, max time."""

from ..core.stopping import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria
from ..core.config import DEFAULTS
from ..registry import hookimpl


@hookimpl
def decodekit_config_fields():
    return {
        name: DEFAULTS[name] for name in ("max_length", "max_new_tokens", "eos_token_id", "stop_strings", "max_time")
    }


@hookimpl(tryfirst=True)
def decodekit_stopping_criteria(generation_config, context):
    gc = generation_config
    out = [MaxLengthCriteria(context.max_length)]
    if gc.eos_token_ids:
        out.append(EosTokenCriteria(gc.eos_token_ids))
    if gc.stop_strings:
        if context.tokenizer is None:
            raise ValueError(
                "stop_strings needs the tokenizer: call generate(..., stop_strings=..., tokenizer=tokenizer)."
            )
        out.append(StopStringCriteria(context.tokenizer, gc.stop_strings))
    if gc.max_time is not None:
        out.append(MaxTimeCriteria(gc.max_time))
    return out
