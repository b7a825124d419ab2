"""custom_generate methods written the way methods published for transformers are written: they call transformers'
generation internals on the model they are handed, build transformers' caches, and import transformers. Run on
transformers' own model and on decodekit's native model from the same checkpoint, they must give the same tokens."""

# A decoding loop handed to transformers' generate(), as the strategies transformers moved to the Hub in 5.x are
# written (transformers-community's group-beam-search, dola, contrastive-search): generate() prepares the call
# (config, special tokens, cache, stopping criteria, processors) and calls the loop, which drives _prefill,
# prepare_inputs_for_generation, _update_model_kwargs_for_generation and _has_unfinished_sequences. The loop is
# top-nσ sampling (keep the tokens within n standard deviations of the best logit), a method people publish.
TOP_N_SIGMA = """
import torch
from transformers import GenerationMixin


def _top_n_sigma(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                 streamer=None, n_sigma=1.0, **model_kwargs):
    pad_token_id = generation_config._pad_token_tensor
    has_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    prefilled = True
    while model._has_unfinished_sequences(False, synced_gpus, device=input_ids.device):
        if not prefilled:
            inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
            outputs = model(**inputs, return_dict=True)
        prefilled = False
        model_kwargs = model._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=model.config.is_encoder_decoder)
        logits = outputs.logits[:, -1].to(dtype=torch.float32)
        scores = logits_processor(input_ids, logits)
        threshold = logits.max(dim=-1, keepdim=True).values - n_sigma * logits.std(dim=-1, keepdim=True)
        scores = scores.masked_fill(logits < threshold, -float("inf"))
        if generation_config.do_sample:
            next_tokens = torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = scores.argmax(dim=-1)
        if has_eos:
            next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        unfinished = unfinished & ~stopping_criteria(input_ids, scores)
        if unfinished.max() == 0:
            break
    if streamer is not None:
        streamer.end()
    return input_ids


def generate(model, *args, **kwargs):
    return GenerationMixin.generate(model, *args, custom_generate=_top_n_sigma, **kwargs)
"""

# Top-nσ as its public repository publishes it: no cache at all, the whole sequence through model(...) every step
# (quadratic work), the mask grown by hand; what the view serves incrementally when the call compiles.
CACHELESS = """
import torch


def generate(model, input_ids, generation_config=None, n_sigma=1.0, attention_mask=None, **kwargs):
    generation_config = generation_config or model.generation_config
    new_tokens = kwargs.get("max_new_tokens") or generation_config.max_new_tokens or 20
    temperature = generation_config.temperature or 1.0
    for _ in range(new_tokens):
        logits = model(input_ids, attention_mask=attention_mask).logits[:, -1, :].float()
        threshold = logits.max(dim=-1, keepdim=True).values - n_sigma * logits.std(dim=-1, keepdim=True)
        logits = logits.masked_fill(logits < threshold, -float("inf"))
        if generation_config.do_sample:
            next_tokens = torch.multinomial((logits / temperature).softmax(dim=-1), num_samples=1)
        else:
            next_tokens = logits.argmax(dim=-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_tokens], dim=-1)
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=-1)
    return input_ids
"""

# A beam-family loop by hand, as methods written against transformers 4.5x drive its internals: the config from
# _prepare_generation_config, rows from _expand_inputs_for_generation, inputs from prepare_inputs_for_generation, the
# cache reordered through _reorder_cache where the model has it (4.5x's models did) or the Cache itself.
BEAM_LOOP = """
import inspect

from transformers import GenerationMixin

# The installed transformers' name for the cache keyword: `cache` from 5.24, `past_key_values` before (the
# transformers extra takes 5.16 on). A method that passed `cache=` to 5.23's model passed nothing it read.
CACHE = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters else "past_key_values"
import torch
from transformers import DynamicCache


def generate(model, input_ids, generation_config=None, attention_mask=None, **kwargs):
    generation_config, _ = model._prepare_generation_config(
        generation_config, **{k: v for k, v in kwargs.items() if v is not None})
    beams, batch = generation_config.num_beams, input_ids.shape[0]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    input_ids, model_kwargs = model._expand_inputs_for_generation(
        expand_size=beams, is_encoder_decoder=model.config.is_encoder_decoder, input_ids=input_ids,
        attention_mask=attention_mask)
    model_kwargs.update({CACHE: DynamicCache(config=model.config)}, use_cache=True)
    scores = torch.zeros(batch, beams, device=input_ids.device)
    scores[:, 1:] = -1e9
    scores = scores.view(-1)
    first = True
    for _ in range(generation_config.max_new_tokens):
        inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=None if first else 1,
                                                     is_first_iteration=first, **model_kwargs)
        outputs = model(**inputs, return_dict=True)
        first = False
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
        logprobs = outputs.logits[:, -1].float().log_softmax(dim=-1)
        vocab = logprobs.shape[-1]
        best, index = (scores[:, None] + logprobs).view(batch, beams * vocab).topk(beams, dim=-1)
        rows = (index // vocab + torch.arange(batch, device=index.device)[:, None] * beams).view(-1)
        input_ids = torch.cat([input_ids[rows], (index % vocab).view(-1, 1)], dim=-1)
        scores = best.view(-1)
        model_kwargs["attention_mask"] = model_kwargs["attention_mask"][rows]
        if hasattr(model, "_reorder_cache"):
            model_kwargs[CACHE] = model._reorder_cache(model_kwargs[CACHE], rows)
        else:
            model_kwargs[CACHE].reorder_cache(rows)
    winners = scores.view(batch, beams).argmax(dim=-1) + torch.arange(batch, device=scores.device) * beams
    return input_ids[winners]
"""

# Greedy decoding that rolls back when it gets stuck (a token repeating the one before it): the previous token is
# taken back, the cache cropped, and that token banned at its position. It calls model(...) itself over a transformers
# cache it builds (dynamic or static) and crops.
ROLLBACK = """
import inspect

from transformers import GenerationMixin

# The installed transformers' name for the cache keyword: `cache` from 5.24, `past_key_values` before (the
# transformers extra takes 5.16 on). A method that passed `cache=` to 5.23's model passed nothing it read.
CACHE = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters else "past_key_values"
import torch
from transformers import DynamicCache, StaticCache


def generate(model, input_ids, generation_config=None, cache_kind="dynamic", max_rollbacks=8, **kwargs):
    generation_config = generation_config or model.generation_config
    prompt = input_ids.shape[1]
    end = prompt + (kwargs.get("max_new_tokens") or generation_config.max_new_tokens or 20)
    if cache_kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=end)
    else:
        cache = DynamicCache(config=model.config)
    predictions = [model(input_ids=input_ids, **{CACHE: cache}, use_cache=True).logits[:, -1].float()]
    banned, rollbacks = {}, 0
    while input_ids.shape[1] < end:
        position = input_ids.shape[1]
        scores = predictions[-1].clone()
        for token in banned.get(position, ()):
            scores[:, token] = -float("inf")
        token = scores.argmax(dim=-1, keepdim=True)
        if position > prompt and token.item() == input_ids[0, -1].item() and rollbacks < max_rollbacks:
            rollbacks += 1
            banned.setdefault(position - 1, set()).add(input_ids[0, -1].item())
            input_ids = input_ids[:, :-1]
            predictions.pop()
            cache.crop(-1)
            continue
        input_ids = torch.cat([input_ids, token], dim=-1)
        predictions.append(model(input_ids=token, **{CACHE: cache}, use_cache=True).logits[:, -1].float())
    return input_ids
"""

# Asks for what only an encoder-decoder model has.
ENCODER_DECODER = """
def generate(model, input_ids, **kwargs):
    encoder = model.get_encoder()
    return model(input_ids=input_ids, encoder_outputs=encoder(input_ids)).logits
"""

# Contrastive search (Su et al., 2022) as transformers-community's contrastive-search repository writes it for 5.x:
# a loop handed to GenerationMixin.generate that reads hidden states, grows the cache to top_k rows a prompt with
# batch_repeat_interleave and keeps the chosen row with batch_select_indices.
CONTRASTIVE = """
import inspect

from transformers import GenerationMixin

# The installed transformers' name for the cache keyword: `cache` from 5.24, `past_key_values` before (the
# transformers extra takes 5.16 on). A method that passed `cache=` to 5.23's model passed nothing it read.
CACHE = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters else "past_key_values"
import torch
from transformers import GenerationMixin


def _contrastive(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                 streamer=None, **model_kwargs):
    top_k, alpha = generation_config.top_k, generation_config.penalty_alpha
    batch = input_ids.shape[0]
    model_kwargs["output_hidden_states"] = True
    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
    context = outputs.hidden_states[-1]
    logits = outputs.logits[:, -1].float()
    while True:
        scores = logits_processor(input_ids, logits)
        probs, candidates = scores.softmax(dim=-1).topk(top_k, dim=-1)
        cache = model_kwargs[CACHE]
        cache.batch_repeat_interleave(top_k)
        mask = model_kwargs.get("attention_mask")  # covers the candidate too (_update_model_kwargs_for_generation)
        if mask is None:
            mask = torch.ones(batch, input_ids.shape[1] + 1, dtype=torch.long, device=input_ids.device)
        mask = mask.repeat_interleave(top_k, dim=0)
        step = model(input_ids=candidates.view(-1, 1), attention_mask=mask, **{CACHE: cache}, use_cache=True,
                     output_hidden_states=True)
        hidden = step.hidden_states[-1]
        similarity = torch.cosine_similarity(hidden, context.repeat_interleave(top_k, dim=0), dim=-1)
        similarity = similarity.masked_fill(mask[:, :-1] == 0, -1.0)  # padding is no context
        degeneration = similarity.max(dim=-1).values.view(batch, top_k)
        best = ((1 - alpha) * probs - alpha * degeneration).argmax(dim=-1)
        rows = best + torch.arange(batch, device=best.device) * top_k
        cache.batch_select_indices(rows)
        next_tokens = candidates[torch.arange(batch), best]
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        context = torch.cat([context, hidden[rows]], dim=1)
        logits = step.logits[rows, -1].float()
        model_kwargs["attention_mask"] = torch.cat([mask[rows], mask.new_ones(batch, 1)], dim=-1)
        if stopping_criteria(input_ids, scores).all():
            return input_ids


def generate(model, *args, **kwargs):
    return GenerationMixin.generate(model, *args, custom_generate=_contrastive, **kwargs)
"""

# Attention sinks (StreamingLLM): a cache of its own that keeps the first `sink` positions and the most recent ones,
# dropping the middle once it holds `window`, as sink-cache methods do; the method calls model(...) with it.
SINK_CACHE = """
import inspect

from transformers import GenerationMixin

# The installed transformers' name for the cache keyword: `cache` from 5.24, `past_key_values` before (the
# transformers extra takes 5.16 on). A method that passed `cache=` to 5.23's model passed nothing it read.
CACHE = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters else "past_key_values"
import torch
from transformers import DynamicCache


class SinkCache(DynamicCache):
    def __init__(self, sink, window, **kwargs):
        super().__init__(**kwargs)
        self.sink, self.window = sink, window

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if layer.keys.shape[-2] > self.window:
            recent = self.window - self.sink
            layer.keys = torch.cat([layer.keys[:, :, :self.sink], layer.keys[:, :, -recent:]], dim=-2)
            layer.values = torch.cat([layer.values[:, :, :self.sink], layer.values[:, :, -recent:]], dim=-2)
        return keys, values


def generate(model, input_ids, generation_config=None, sink=2, window=8, **kwargs):
    generation_config = generation_config or model.generation_config
    end = input_ids.shape[1] + (kwargs.get("max_new_tokens") or generation_config.max_new_tokens or 20)
    cache = SinkCache(sink, window)
    logits = model(input_ids=input_ids, **{CACHE: cache}, use_cache=True).logits[:, -1]
    while input_ids.shape[1] < end:
        token = logits.argmax(dim=-1, keepdim=True)
        input_ids = torch.cat([input_ids, token], dim=-1)
        logits = model(input_ids=token, **{CACHE: cache}, use_cache=True).logits[:, -1]
    assert cache.get_seq_length() <= window
    return input_ids
"""

# Prepares its own inputs, then lets the model's generate() do the rest, as many small published methods do.
REENTERS_GENERATE = """
def generate(model, input_ids, **kwargs):
    prefix = input_ids[:, :1].repeat(1, 2)
    return model.generate(
        torch.cat([prefix, input_ids], dim=-1), max_new_tokens=kwargs.get("max_new_tokens", 5), repetition_penalty=1.3,
        eos_token_id=None, do_sample=False)


import torch  # noqa: E402
"""
