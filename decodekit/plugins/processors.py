"""Built-in logits processors (penalties, constraints, sampling warpers), chosen from the generation config.

Each declares its stage (core.processors.STAGES), which places it in the call's pipeline: the biases, penalties, bans and
forced tokens in transformers' order ("penalties"), then the sampling warpers in WARPER_ORDER ("samplers"; llama.cpp's
chain replaces them where the call asks for it: plugins/llamacpp_samplers.py, its own order), and renormalize_logits
last of all ("final").
"""

from ..core.penalties import (
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    FrequencyPresencePenaltyLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from ..core.warpers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopKTopPLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from ..core.config import DEFAULTS, is_number
from ..core.sampler_chain import chain_active
from ..registry import hookimpl


def _top_k_top_p(gc, keep):
    top_p = gc.top_p not in (None, 1.0)
    if gc.top_k and top_p:
        return TopKTopPLogitsWarper(gc.top_k, gc.top_p, min_tokens_to_keep=keep)
    if gc.top_k:
        return TopKLogitsWarper(gc.top_k, min_tokens_to_keep=keep)
    return TopPLogitsWarper(gc.top_p, min_tokens_to_keep=keep) if top_p else None


# transformers' order of the sampling warpers, as data: (name, the warper a config asks for or None). `keep` is the
# tokens a warper always keeps (min_tokens_to_keep).
WARPER_ORDER = (
    (
        "temperature",
        lambda gc, keep: TemperatureLogitsWarper(gc.temperature) if gc.temperature not in (None, 1.0) else None,
    ),
    ("top_h", lambda gc, keep: TopHLogitsWarper(gc.top_h) if gc.top_h is not None else None),
    ("top_k, top_p", _top_k_top_p),
    ("min_p", lambda gc, keep: MinPLogitsWarper(gc.min_p, min_tokens_to_keep=keep) if gc.min_p else None),
    (
        "typical_p",
        lambda gc, keep: (
            TypicalLogitsWarper(gc.typical_p, min_tokens_to_keep=keep) if gc.typical_p not in (None, 1.0) else None
        ),
    ),
    (
        "epsilon_cutoff",
        lambda gc, keep: EpsilonLogitsWarper(gc.epsilon_cutoff, min_tokens_to_keep=keep) if gc.epsilon_cutoff else None,
    ),
    (
        "eta_cutoff",
        lambda gc, keep: EtaLogitsWarper(gc.eta_cutoff, min_tokens_to_keep=keep) if gc.eta_cutoff else None,
    ),
)

FIELDS = (
    "sequence_bias",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "min_length",
    "min_new_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "renormalize_logits",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "encoder_repetition_penalty",
)


@hookimpl
def decodekit_config_fields():
    # prefix_allowed_tokens_fn is an argument of transformers' generate(), not a config field there; here it is
    # one, so generate(prefix_allowed_tokens_fn=...) reaches this plugin like every other keyword.
    # frequency_penalty and presence_penalty: OpenAI's (and vLLM's and llama.cpp's) penalties on generated tokens.
    return {
        **{name: DEFAULTS[name] for name in FIELDS},
        "prefix_allowed_tokens_fn": None,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "top_h": None,
    }


@hookimpl
def decodekit_validate_config(generation_config):
    gc = generation_config
    fn = gc.prefix_allowed_tokens_fn
    if fn is not None and not callable(fn):
        raise gc.invalid(
            "prefix_allowed_tokens_fn",
            "expected a function (batch_id, input_ids) -> list of allowed token ids, or None",
        )
    if gc.top_h is not None and (not is_number(gc.top_h) or not 0 < gc.top_h <= 1):
        raise gc.invalid("top_h", "expected a number in (0, 1] or None (off)")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(gc, name)
        if value is not None and (not is_number(value) or not -2 <= value <= 2):
            raise gc.invalid(name, "expected a number in [-2, 2] (0: off), as OpenAI's")


@hookimpl
def decodekit_logits_processors(generation_config, context):
    gc = generation_config
    eos = gc.eos_token_ids
    out = []
    if gc.sequence_bias:
        out.append(SequenceBiasLogitsProcessor(gc.sequence_bias))
    if gc.repetition_penalty not in (None, 1.0):
        # A left-padded row's pad positions are not its tokens: they are not penalised (transformers 5.x).
        out.append(RepetitionPenaltyLogitsProcessor(gc.repetition_penalty, prompt_ignore_length=context.padding))
    if gc.frequency_penalty or gc.presence_penalty:
        out.append(
            FrequencyPresencePenaltyLogitsProcessor(
                gc.frequency_penalty or 0.0, gc.presence_penalty or 0.0, context.prompt_length
            )
        )
    if gc.no_repeat_ngram_size:
        out.append(NoRepeatNGramLogitsProcessor(gc.no_repeat_ngram_size))
    if gc.bad_words_ids:
        out.append(NoBadWordsLogitsProcessor(gc.bad_words_ids, eos))
    if eos and gc.min_length > context.prompt_length:
        out.append(MinLengthLogitsProcessor(gc.min_length, eos))
    if eos and gc.min_new_tokens:
        out.append(MinNewTokensLengthLogitsProcessor(context.prompt_length, gc.min_new_tokens, eos))
    if gc.prefix_allowed_tokens_fn is not None:
        out.append(PrefixConstrainedLogitsProcessor(gc.prefix_allowed_tokens_fn, gc.number("num_beams", 1)))
    if gc.forced_bos_token_id is not None:
        out.append(ForcedBOSTokenLogitsProcessor(gc.forced_bos_token_id))
    if gc.forced_eos_token_id is not None:
        out.append(ForcedEOSTokenLogitsProcessor(context.max_length, gc.forced_eos_token_id))
    if gc.remove_invalid_values:
        out.append(InfNanRemoveLogitsProcessor())
    if gc.exponential_decay_length_penalty is not None and eos:
        out.append(ExponentialDecayLengthPenalty(gc.exponential_decay_length_penalty, eos, context.prompt_length))
    if gc.suppress_tokens:
        out.append(SuppressTokensLogitsProcessor(gc.suppress_tokens))
    if gc.begin_suppress_tokens:
        # As transformers: a one-token prompt followed by a forced BOS starts one position later.
        begin = context.prompt_length + (1 if context.prompt_length == 1 and gc.forced_bos_token_id is not None else 0)
        out.append(SuppressTokensAtBeginLogitsProcessor(gc.begin_suppress_tokens, begin))
    if gc.do_sample and not chain_active(gc):
        # Warpers shape the sampling distribution; for greedy decoding they cannot change the argmax. Beam sampling
        # keeps one token more than there are EOS ids, so a beam can always go on (transformers' rule).
        keep = (len(eos) + 1 if eos else 2) if gc.number("num_beams", 1) > 1 else 1
        out.extend(w for w in (make(gc, keep) for _, make in WARPER_ORDER) if w is not None)
    if gc.renormalize_logits:
        out.append(LogitNormalization())
    return out
