"""{{ cookiecutter.description }}"""
{%- if cookiecutter.hook_point == "full loop" %}

import inspect

import torch


def cache_keyword(model) -> str:
    """The name the model's forward takes its KV cache under: `cache` (transformers 5.24 on, which deprecates the
    older name), `past_key_values` (transformers before 5.24, decodekit's own models)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output):
    """The KV cache a forward returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def generate(model, input_ids=None, generation_config=None, attention_mask=None, streamer=None, avoid_last_n=0,
             inputs=None, **kwargs):
    """Greedy decoding or sampling with a KV cache, never repeating any of the last `avoid_last_n` tokens.

    Runs as decodekit's custom_generate and as transformers' own (`model.generate(inputs, custom_generate=...)`).
    model: any model with the transformers forward contract (decodekit or transformers).
    input_ids (or inputs, as transformers passes it): LongTensor [batch, prompt length], left-padded if batched
        (pass attention_mask then).
    generation_config: defaults to model.generation_config; keyword arguments such as max_new_tokens,
        do_sample or temperature override it.
    avoid_last_n: int >= 0, the example argument of this method.
    Returns the sequences, prompt included, as a LongTensor [batch, prompt length + new tokens].
    """
    input_ids = inputs if inputs is not None else input_ids
    if input_ids is None:
        raise ValueError("generate() needs the prompt as input_ids (or inputs): a LongTensor [batch, prompt length].")
    config = generation_config or model.generation_config
    max_new_tokens = kwargs.get("max_new_tokens") or getattr(config, "max_new_tokens", None) or 20
    do_sample = kwargs.get("do_sample", getattr(config, "do_sample", False))
    temperature = kwargs.get("temperature", getattr(config, "temperature", 1.0)) or 1.0
    eos = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if eos else 0)
    if not isinstance(avoid_last_n, int) or avoid_last_n < 0:
        raise ValueError(f"avoid_last_n={avoid_last_n!r} is invalid; expected an integer >= 0.")

    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
        for _ in range(max_new_tokens):
            scores = out.logits[:, -1, :].float()
            if avoid_last_n:
                scores = scores.scatter(-1, input_ids[:, -avoid_last_n:], -float("inf"))
            if do_sample:
                next_tokens = torch.multinomial(torch.softmax(scores / temperature, dim=-1), 1)[:, 0]
            else:
                next_tokens = scores.argmax(dim=-1)
            next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            if streamer is not None:
                streamer.put(next_tokens.cpu())
            if eos:
                unfinished &= ~torch.isin(next_tokens, torch.tensor(eos, device=next_tokens.device))
                if not unfinished.any():
                    break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=-1)
            positions = positions[:, -1:] + 1
            out = model(next_tokens[:, None], attention_mask=attention_mask, position_ids=positions,
                        **{cache_keyword(model): cache_of(out)}, use_cache=True)
    if streamer is not None:
        streamer.end()
    return input_ids
{%- else %}

# This method does not replace the decode loop: it plugs into the loop through its hook points. The
# functions below are registered for each generate() call that names this method.
{% include "hooks.py.j2" %}


# The entry point transformers' generate(custom_generate=...) calls. With decodekit installed it runs the hooks
# above inside transformers' own loop (decodekit's loop where the method selects tokens or makes the cache), and
# decodekit itself uses the hooks directly. With transformers alone (transformers only checks imports outside
# try/except), standalone_generate runs them in transformers' loop by itself.
try:
    from decodekit.integrations.entry import hooks_entry_point
except ImportError:
    hooks_entry_point = None
{% include "standalone.py.j2" %}

generate = hooks_entry_point(__name__) if hooks_entry_point is not None else standalone_generate
{%- endif %}
