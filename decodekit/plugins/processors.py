"""Built-in logits processors (penalties, constraints, sampling warpers), chosen from the generation config.

They run in transformers' order: penalties and constraints first, then the sampling warpers
(temperature, top-k, top-p, min-p, typical-p).
"""

from ..core import processors as P
from ..core.config import DEFAULTS
from ..registry import hookimpl

FIELDS = ("sequence_bias", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
          "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "temperature", "top_k", "top_p", "min_p",
          "typical_p")


@hookimpl
def decodekit_config_fields():
    return {name: DEFAULTS[name] for name in FIELDS}


@hookimpl(tryfirst=True)
def decodekit_logits_processors(generation_config, context):
    gc = generation_config
    eos = gc.eos_token_ids
    out = []
    if gc.sequence_bias:
        out.append(P.SequenceBiasLogitsProcessor(gc.sequence_bias))
    if gc.repetition_penalty not in (None, 1.0):
        out.append(P.RepetitionPenaltyLogitsProcessor(gc.repetition_penalty))
    if gc.no_repeat_ngram_size:
        out.append(P.NoRepeatNGramLogitsProcessor(gc.no_repeat_ngram_size))
    if gc.bad_words_ids:
        out.append(P.NoBadWordsLogitsProcessor(gc.bad_words_ids, eos))
    if eos and gc.min_length > context.prompt_length:
        out.append(P.MinLengthLogitsProcessor(gc.min_length, eos))
    if eos and gc.min_new_tokens:
        out.append(P.MinNewTokensLengthLogitsProcessor(context.prompt_length, gc.min_new_tokens, eos))
    if gc.forced_bos_token_id is not None:
        out.append(P.ForcedBOSTokenLogitsProcessor(gc.forced_bos_token_id, context.prompt_length))
    if gc.forced_eos_token_id is not None:
        out.append(P.ForcedEOSTokenLogitsProcessor(context.max_length, gc.forced_eos_token_id))
    if gc.suppress_tokens:
        out.append(P.SuppressTokensLogitsProcessor(gc.suppress_tokens))
    if gc.do_sample:
        # Warpers shape the sampling distribution; for greedy decoding they cannot change the argmax.
        if gc.temperature not in (None, 1.0):
            out.append(P.TemperatureLogitsWarper(gc.temperature))
        top_p = gc.top_p not in (None, 1.0)
        if gc.top_k and top_p:
            out.append(P.TopKTopPLogitsWarper(gc.top_k, gc.top_p))
        elif gc.top_k:
            out.append(P.TopKLogitsWarper(gc.top_k))
        elif top_p:
            out.append(P.TopPLogitsWarper(gc.top_p))
        if gc.min_p:
            out.append(P.MinPLogitsWarper(gc.min_p))
        if gc.typical_p not in (None, 1.0):
            out.append(P.TypicalLogitsWarper(gc.typical_p))
    return out
