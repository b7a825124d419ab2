"""What a generate() call would allocate, estimated and checked before anything is allocated.

An absurd value (num_beams=10**9, max_new_tokens=10**12) should be a sentence naming the fields, not an
allocator's error from deep inside a loop, or a machine swapping until it dies. The estimate counts the
KV cache (rows x max_length x every layer's keys and values) and the per-step scores a call keeps; the
limit is the memory available now (the device's free memory on an accelerator).
"""

from __future__ import annotations

import torch

from ..sizes import host_memory_available, human_size


def available_bytes(device: torch.device) -> int | None:
    """Memory a call could still take on `device`, or None where it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return host_memory_available()


def bytes_per_position(model) -> int:
    """Bytes of keys and values one row's cache takes per position; 0 where the model's config does not tell."""
    config = getattr(model, "config", None)

    def field(name: str):
        try:
            return getattr(config, name, None)
        except Exception:  # noqa: BLE001 - a config that refuses a global value (per-layer sizes) tells nothing
            return None

    layers = field("num_hidden_layers")
    heads = field("num_key_value_heads") or field("num_attention_heads")
    hidden, n_heads = field("hidden_size"), field("num_attention_heads")
    head_dim = field("head_dim") or (
        hidden // n_heads if isinstance(hidden, int) and isinstance(n_heads, int) and n_heads else None
    )
    if not all(isinstance(v, int) for v in (layers, heads, head_dim)):
        return 0
    dtype = getattr(model, "dtype", torch.float32)
    return 2 * layers * heads * head_dim * (torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4)


def check_call_size(model, gc, prompts: int, rows_per_prompt: int, prompt_length: int, max_length: int) -> None:
    """ValueError naming the fields if the call's estimated memory is over what is available."""
    rows = prompts * rows_per_prompt
    steps = max_length - prompt_length
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 0
    cache = rows * max_length * bytes_per_position(model) if gc.use_cache else 0
    kept = rows * steps * vocab * 4 * (int(bool(gc.output_scores)) + int(bool(gc.output_logits)))
    # The prompt rows' forward: one float32 [rows, vocab] score matrix at least.
    need = cache + kept + rows * vocab * 4
    device = getattr(model, "device", torch.device("cpu"))
    free = available_bytes(torch.device(device))
    if free is None or need <= free:
        return
    fields = [
        f"{prompts} prompt(s) x {rows_per_prompt} row(s) each (num_beams / num_return_sequences)",
        f"max_length {max_length} (prompt {prompt_length} + max_new_tokens {steps})",
    ]
    if kept:
        fields.append("output_scores / output_logits keep every step's scores")
    raise ValueError(
        f"generate() would need about {human_size(need)} ({'; '.join(fields)}), more than the {human_size(free)} available "
        f"on {device}. Lower max_new_tokens, num_beams, num_return_sequences or the batch."
    )
