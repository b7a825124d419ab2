"""The Llama family in plain PyTorch: Llama 2/3, SmolLM, Mistral, Qwen2/2.5 and Qwen3.

One module covers them all; config fields select the differences (q/k/v bias, q/k RMSNorm, sliding
windows, tied embeddings, rope scaling). For speed at batch 1, where decoding is bound by how fast
weights stream from memory, q/k/v are one matmul, gate/up are one matmul, linear weights are packed
for oneDNN on CPU at the first forward without gradients (packed.py), and attention reads only the
filled part of the cache. In a fixed-shape decode step on CPU the layers run as one call into
decodekit's C++ (`decodekit::decode_layers`, native.py), which computes what `Block` computes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import elementwise, native
from ..kernels.linear import INTERLEAVED, PROMPT_ROUTES, Linear, lacks_matmul_instructions, prompt_choice
from ..kernels.step_host import StepHost
from ..kernels.packed import pack_linears, unpack_linears
from ..kernels.attention import by_route, prompt_attention, prompt_attention_route, wide_softmax
from ..kernels import quantize
from ..kernels.blocks import BlockLinear
from ..kernels.quantize import Int8Linear
from .cache import DynamicCache, StaticCache
from .config import ModelConfig
from .outputs import CausalLMOutput
from .rope import RotaryTable, apply_rotary


# DECODEKIT_NATIVE_LAYERS=0 keeps the Python layers in fixed-shape steps and prompts (to compare the two).
NATIVE_LAYERS = os.environ.get("DECODEKIT_NATIVE_LAYERS", "1") != "0"
PROMPT_DTYPES = (torch.float32, torch.bfloat16)  # activations of the C++ prompt layers (_prompt_layers)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = elementwise.rms_norm(x, self.weight, self.eps)  # a prompt on CPU: one pass (kernels/elementwise.py)
        if fused is not None:
            return fused
        # Normalise in fp32 and scale after casting back, as the reference implementation does.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def one_query_attention(q, k, v, mask):
    """Attention of one query position per row, in float32: bf16/fp16 caches on CPU, and every compiled step on CPU.

    q [B, H, 1, D]; k, v [B, KV, L, D]; mask boolean [B or 1, 1, 1, L] or None. The CPU kernels of
    scaled_dot_product_attention for bf16 are slow for a single query (about three times this function's time a
    layer; docs/performance.md), and float32 scores are at least as precise
    as the fused kernel's. In a compiled step both products are written as a broadcast multiply and a sum,
    which inductor fuses into the step's own loops instead of calling SDPA or bmm once per layer.
    """
    B, H, _, D = q.shape
    kv, dtype = k.shape[1], q.dtype
    q = q.reshape(B, kv, H // kv, D).float()
    k, v = k.float(), v.float()
    fused = torch.compiler.is_compiling()
    scores = ((q[:, :, :, None, :] * k[:, :, None]).sum(-1) if fused else q @ k.transpose(-1, -2)) * D**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = (probs[..., None] * v[:, :, None]).sum(-2) if fused else probs @ v
    return out.to(dtype).reshape(B, H, 1, D)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window_for_layer(layer_idx)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o = Linear(q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    @property
    def int8(self) -> bool:
        """Whether this layer's weights are int8 (quantize.Int8Linear): its float32 prompt attention may then run in
        bfloat16 products (attention.prompt_attention_route)."""
        return type(self.qkv) is Int8Linear

    def forward(self, x, cos, sin, cache, masks, slots=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if getattr(cache, "paged", False):  # continuous batching: the tokens of many requests (batching/paged.py)
            y = cache.attend(q, k, v, self.layer_idx, self.window, self.int8)
            return self.o(y.transpose(1, 2).reshape(B, T, -1))
        if slots is not None:
            k, v = cache.write(k, v, self.layer_idx, slots)
        elif cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        mask = masks.get(self.window, masks.get(None))
        y = None
        if T == 1 and q.device.type == "cpu" and (q.dtype != torch.float32 or torch.compiler.is_compiling()):
            y = one_query_attention(q, k, v, mask)
        elif B == 1 and not masks:  # one unpadded prompt, plain causal: decodekit's kernel where it measured faster
            y = prompt_attention(q[0], k[0], v[0], None, self.int8)
            y = None if y is None else y[None]
        if y is None:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, enable_gqa=self.n_kv != self.n_heads
            )
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up = Linear(config.hidden_size, 2 * self.inter, bias=config.mlp_bias)
        self.down = Linear(self.inter, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        gate_up = self.gate_up(x)
        hidden = elementwise.silu_mul(gate_up)  # a prompt on CPU: one pass (kernels/elementwise.py)
        if hidden is None:
            gate, up = gate_up.split(self.inter, dim=-1)
            hidden = F.silu(gate) * up
        return self.down(hidden)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache, masks, slots=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, masks, slots)
        return x + self.mlp(self.mlp_norm(x))

    def prompt_plan(self, x: torch.Tensor, rows: int, decided: dict) -> tuple[tuple, tuple] | None:
        """The operands of decodekit::prompt_layer_start and prompt_layer_end (after the rows) for a prompt of `rows`
        rows like x: each product's operand, route, bias and scales (Linear.prompt_route, Int8Linear.prompt_route),
        and the norms; None where a product is none of those the calls take: a Linear of x's dtype computed in
        float32 (float32 weights; bfloat16 ones on a CPU without bfloat16 matrix instructions), or, for float32 rows,
        an Int8Linear whose route is one of decodekit's kernels. `decided` keeps the routes' choices, the same for
        every layer (filled on first need, not looked up for each of a model's products)."""
        attn, mlp = self.attn, self.mlp
        products = []
        for linear in (attn.qkv, attn.o, mlp.gate_up, mlp.down):
            scales, flags = None, 0
            # A bfloat16 Linear: its products run in float32 for rows past FLOAT32_FROM_ROWS, which a prompt's pass.
            if (
                type(linear) is Linear
                and linear.weight.dtype == x.dtype
                and (x.dtype == torch.float32 or lacks_matmul_instructions(x.dtype))
            ):
                route, operand = linear.prompt_route(x, rows, decision(decided, x.dtype, rows))
            elif (
                type(linear) is Int8Linear
                and x.dtype == torch.float32
                and (named := linear.prompt_route(x, rows, choice=decision(decided, torch.int8, rows))) is not None
            ):
                route, operand = named
                interleaved = linear.input_order is not None
                if route == "int8_tiles" and interleaved and linear.in_features % 32:
                    return None  # the Python layer reorders the rows first
                if operand.dtype == torch.int8:  # the weight itself, not a copy (dequantized, in the input's order)
                    scales, flags = linear.scales.float(), INTERLEAVED if interleaved else 0
            else:
                return None
            bias = None if linear.bias is None else linear.bias.float()  # added in float32, as Linear._many_rows
            products.append((operand, PROMPT_ROUTES[route] + flags, bias, scales))
        (qkv, o, gate_up, down), eps = products, self.attn_norm.eps
        q_norm, k_norm = (None if n is None else n.weight for n in (attn.q_norm, attn.k_norm))
        start = (self.attn_norm.weight, eps, *qkv, q_norm, k_norm)
        end = (*o, self.mlp_norm.weight, self.mlp_norm.eps, *gate_up, *down)
        return start, end

    def native_operands(self) -> tuple | None:
        """(weights, scales, biases, norms) for decodekit::decode_layers (kernels/csrc/decode_layers.cpp), or None where a
        linear layer's weight is not one it reads: plain float32/bfloat16, int8 interleaved (width % 32 == 0), or
        blocks (kernels/blocks.py)."""
        linears = (self.attn.qkv, self.attn.o, self.mlp.gate_up, self.mlp.down)
        weights, scales = [], []
        for linear in linears:
            if isinstance(linear, Int8Linear) and linear.in_features % 32 == 0:
                weights.append(linear.weight_int8)
                scales.append(linear.scales.float())
            elif type(linear) is BlockLinear:
                weights.append(linear.blocks)
                scales.append(None)
            elif type(linear) is Linear and linear.weight.dtype in native.LAYER_DTYPES:
                weights.append(linear.weight)
                scales.append(None)
            else:
                return None
        attn = self.attn
        norms = [self.attn_norm.weight, self.mlp_norm.weight] + [
            None if n is None else n.weight for n in (attn.q_norm, attn.k_norm)
        ]
        return weights, scales, [linear.bias for linear in linears], norms


def decision(decided: dict, dtype: torch.dtype, rows: int) -> tuple[str, bool]:
    """The prompt route choice for `rows` rows by weights of `dtype` (float32 or bfloat16: linear.prompt_choice; int8:
    quantize.prompt_choice), looked up once into `decided`."""
    if dtype not in decided:
        decided[dtype] = quantize.prompt_choice(rows) if dtype == torch.int8 else prompt_choice(dtype, rows)
    return decided[dtype]


def kept_positions(x: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The positions of x [B, T, H] whose logits are computed: the last `logits_to_keep` (0: all), or, as in
    transformers, the positions a 1-D tensor lists."""
    if isinstance(logits_to_keep, torch.Tensor):
        return x[:, logits_to_keep.to(x.device)]
    return x[:, -logits_to_keep:] if logits_to_keep else x


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether the key at k_pos is visible to the query at q_pos: causal, and within the window if there is one."""
    allowed = k_pos <= q_pos
    return allowed if window is None else allowed & (k_pos > q_pos - window)


def build_masks(attention_mask, past: int, T: int, windows: set, device) -> dict:
    """Boolean attention masks [B or 1, 1, T, past+T], one per distinct sliding window (None: full).

    An empty dict means plain causal attention needs no mask (the common batch-1 case), which lets
    SDPA take its fastest path.
    """
    kv = past + T
    padded = attention_mask is not None and not bool(attention_mask.all())
    windowed = any(w is not None and kv > w for w in windows)
    if not padded and not windowed and (T == 1 or past == 0):
        return {}
    q_pos = torch.arange(past, kv, device=device)[:, None]
    k_pos = torch.arange(kv, device=device)[None, :]
    masks = {}
    for w in windows:
        allowed = visible(q_pos, k_pos, w)[None, None]
        if padded:
            allowed = allowed & attention_mask[:, None, None, :].bool()
            # A left-pad query sees no key at all; let it see everything rather than produce NaN.
            # Its output is never read: real tokens never attend to pad keys.
            allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        masks[w] = allowed
    return masks


def static_masks(key_mask: torch.Tensor, slots: torch.Tensor, windows: set) -> dict:
    """Masks [B, 1, T, L] over a whole fixed-size cache: key slot j is visible to the query in slot s if
    j <= s, the key is not padding (key_mask [B, L]) and, with a window w, j > s - w. Tensors only."""
    k_pos = torch.arange(key_mask.shape[1], device=key_mask.device)[None, :]
    q_pos = slots[:, None]
    masks = {}
    for w in windows:
        masks[w] = visible(q_pos, k_pos, w)[None, None] & key_mask[:, None, None, :].bool()
    return masks


def _check_forward_arguments(input_ids, inputs_embeds, ignored: dict) -> None:
    """TypeError for an argument forward() does not take (output_attentions=True among them: attention runs fused);
    ValueError unless exactly one of input_ids (2-D) and inputs_embeds is given."""
    unknown = set(ignored) - {"output_attentions"}
    if unknown or ignored.get("output_attentions"):
        raise TypeError(
            f"forward() got unsupported arguments {sorted(unknown or ['output_attentions=True'])}; it accepts "
            "input_ids, attention_mask, position_ids, past_key_values, use_cache, output_hidden_states, "
            "inputs_embeds, logits_to_keep, exit_layer."
        )
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("forward() needs exactly one of input_ids or inputs_embeds.")
    if input_ids is not None and input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, seq], got shape {tuple(input_ids.shape)}.")


class LlamaForCausalLM(nn.Module):
    """A decoder-only Llama-family model with the transformers forward contract. It knows nothing of generation:
    decodekit.facade.Model gives it generate(), generate_batch() and init_continuous_batching()."""

    returns_attentions = False  # attention runs fused (SDPA, the C++ stack): no weights to return
    # The compiled steps it runs (core.fused_loop.supports_step): generate(compile=True)'s step over a StaticCache and
    # continuous batching's over a PagedCache.
    steps_supported = ("fused", "paged")

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Initialised only off the meta device: under torch.device("meta") (how loading builds models) nn.Embedding's
        # own initialisation imports torch's Python meta kernels, some 800 modules that then stay in the process.
        table = torch.empty(config.vocab_size, config.hidden_size)
        if table.device.type != "meta":
            nn.init.normal_(table)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = RotaryTable(config.head_dim, config.rope(), min(config.max_position_embeddings, 4096))
        self.windows = {layer.attn.window for layer in self.layers}
        self._native_handle = self._native_bound = None  # see bind_native_layers
        self.step_host = StepHost()  # its compiled steps and the lock over its weight layout (kernels/step_host.py)

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda() and friends act on plain weights; the next forward decides again whether
        # the new dtype and device can be packed.
        if getattr(self, "_packed_linears", None):
            unpack_linears(self)
        self._packed_linears = None
        if getattr(self, "_native_handle", None) is not None:
            self._unbind_native_layers()  # the weights are about to be replaced
        return super()._apply(fn, recurse)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the norms' (linear and embedding weights may be kept in blocks or int8)."""
        return self.norm.weight.dtype

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        use_cache: bool = True,
        output_hidden_states: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool = True,
        exit_layer: int | None = None,
        **ignored,
    ) -> CausalLMOutput:
        """`exit_layer`: run only the first `exit_layer` layers, then the final norm and LM head (the draft of
        self-speculative decoding; its cache then holds those layers only)."""
        cache_position = ignored.pop("cache_position", None)
        _check_forward_arguments(input_ids, inputs_embeds, ignored)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        if isinstance(cache_position, torch.Tensor):
            return self._forward_fixed(x, attention_mask, position_ids, past_key_values, cache_position, logits_to_keep)
        if not torch.is_grad_enabled():
            if torch.compiler.is_compiling():
                pack_linears(self)  # decided before the trace, under the caller's lock: an attribute read
            else:
                with self.step_host.if_free() as free:
                    if free:  # else another thread's compiled call holds the layout: run on it as it is
                        pack_linears(self)

        cache = past_key_values
        if cache is None and use_cache:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
            raise ValueError(
                f"attention_mask must have shape [batch, past + new] = {(B, past + T)}, got {tuple(attention_mask.shape)}."
            )
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(past, past + T, device=x.device).expand(B, T)
        # Code being compiled cannot grow the table: its caller ensure()s it for every position first.
        cos, sin = self.rotary.lookup(position_ids, x.dtype, checked=not torch.compiler.is_compiling())
        paged = getattr(cache, "paged", False)  # its attention masks by itself
        masks = {} if paged else build_masks(attention_mask, past, T, self.windows, x.device)

        x, hidden_states = self._layers(x, cos, sin, cache, masks, past, self.layers[:exit_layer], output_hidden_states)
        logits = self.lm_head(kept_positions(x, logits_to_keep))
        return CausalLMOutput(logits=logits, past_key_values=cache if use_cache else None, hidden_states=hidden_states)

    def _layers(self, x, cos, sin, cache, masks, past: int, layers, output_hidden_states: bool):
        """(x after `layers` and the final norm, the hidden states after each where asked, else None): the prompt's
        C++ route where it can take the call (_prompt_layers), else layer by layer."""
        hidden_states = [x] if output_hidden_states else None
        prompt = None
        if not (output_hidden_states or masks):
            prompt = self._prompt_layers(layers, x, cos, sin, cache, past)
        x = x if prompt is None else prompt
        for layer in layers if prompt is None else ():
            x = layer(x, cos, sin, cache, masks)
            if hidden_states is not None:
                hidden_states.append(x)
        x = self.norm(x)
        if hidden_states is not None:
            hidden_states[-1] = x  # the last entry is after the final norm, as in transformers
        return x, tuple(hidden_states) if hidden_states is not None else None

    def _prompt_layers(self, layers, x, cos, sin, cache, past: int) -> torch.Tensor | None:
        """x after `layers` for the rows of one prompt (plain causal attention, no mask), or of a continuous
        batching step (a PagedBatch: prompt chunks and decode rows of many requests), float32 or bfloat16 on CPU, in
        decodekit's C++: what Block computes, by the same kernels, without the Python between them. A prompt's layer
        is two calls (decodekit::prompt_layer_start, prompt_layer_end), its cache updated between them; a batch's
        layer runs its attention in between (PagedBatch.attend), then decodekit::prompt_layer_finish. None where
        the Python layers run instead: fewer rows than a prompt's products take, autograd or a trace recording, a
        product none of whose routes the calls take (Block.prompt_plan), or a prompt whose attention SDPA runs on
        this CPU (prompt_attention_route)."""
        B, T, hidden = x.shape
        if not (NATIVE_LAYERS and B == 1 and T > native.MAX_ROWS and x.device.type == "cpu"):
            return None
        if (
            x.dtype not in PROMPT_DTYPES
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or not native.load()
        ):
            return None
        paged = getattr(cache, "paged", False)
        int8 = layers[0].attn.int8 if len(layers) else False
        route = None if paged else prompt_attention_route(past + T, x.dtype, int8)  # a batch's chunks choose their own
        if route == "sdpa":
            return None
        decided = {}
        plans = [layer.prompt_plan(x, T, decided) for layer in layers]
        if any(plan is None for plan in plans):
            return None
        c = self.config
        cos, sin = cos[0, 0], sin[0, 0]
        wide = wide_softmax()
        ops = torch.ops.decodekit
        rows = x.reshape(T, hidden).clone()  # updated in place, layer by layer; x may be the caller's inputs_embeds
        for layer, (start, end) in zip(layers, plans):
            q, k, v = ops.prompt_layer_start(rows, *start, cos, sin, c.num_attention_heads, c.num_key_value_heads)
            if paged:
                attended = cache.attend(q, k, v, layer.attn.layer_idx, layer.attn.window, int8)  # [1, heads, T, D]
                ops.prompt_layer_finish(rows, attended[0].transpose(0, 1).reshape(T, -1), *end, c.intermediate_size)
                continue
            if cache is not None:
                k, v = cache.update(k, v, layer.attn.layer_idx)
            if route == "kernel":  # the float32 kernel, called by prompt_layer_end itself
                ops.prompt_layer_end(rows, q, k, v, 0, wide, *end, c.intermediate_size)
                continue
            attended = by_route(route, q[0], k[0], v[0], 0)  # [heads, T, D]
            ops.prompt_layer_finish(rows, attended.transpose(0, 1).reshape(T, -1), *end, c.intermediate_size)
        return rows.view(B, T, hidden)

    def _forward_fixed(self, x, attention_mask, position_ids, cache, slots, logits_to_keep):
        """The fixed-shape forward of a compiled decode step: a StaticCache written at tensor slot indices,
        attention over the whole cache with `attention_mask` [B, max_cache_len] marking the valid slots,
        explicit position_ids, no host reads."""
        if not isinstance(cache, StaticCache) or position_ids is None or attention_mask is None:
            raise ValueError(
                "cache_position (the fixed-shape path) needs a StaticCache, position_ids and an "
                "attention_mask over the whole cache [batch, max_cache_len]."
            )
        cos, sin = self.rotary.lookup(position_ids, x.dtype, checked=False)
        masks = static_masks(attention_mask, slots, self.windows)
        if cache.rows is not None:
            cache.claim(slots)
        stack = self._native_stack(x, cache)
        if stack is not None:
            x = self._native_layers(x, cos, sin, cache, masks, slots, stack)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, cache, masks, slots)
        x = self.norm(x)
        return CausalLMOutput(logits=self.lm_head(kept_positions(x, logits_to_keep)), past_key_values=cache)

    def bind_native_layers(self) -> int | None:
        """Binds the layers' current weights to decodekit::decode_layers (kernels/csrc/decode_layers.cpp) and returns their
        handle, or None (releasing any earlier binding) where the C++ stack cannot run them: a weight it does
        not read, kernels not built, or autograd recording. generate(compile=True) calls it before every
        call's steps, so a step sees the weights as they are; a model compiled by hand on the fixed-shape path
        should call it before tracing, else its trace keeps the Python layers."""
        operands = [layer.native_operands() for layer in self.layers]
        tensors = [t for layer in operands if layer is not None for kind in layer for t in kind]
        if any(o is None for o in operands) or not native.ready(*tensors):
            self._unbind_native_layers()
            return None
        if self._native_handle is None:
            self._native_handle = native.weights_handle(self)
        weights, scales, biases, norms = ([t for layer in operands for t in layer[k]] for k in range(4))
        torch.ops.decodekit.bind_weights(self._native_handle, weights, scales, biases, norms)
        self._native_bound = self._native_handle
        return self._native_bound

    def _unbind_native_layers(self) -> None:
        if self._native_handle is not None:
            native.unbind(self._native_handle)
        self._native_bound = None

    def runs_native_layers(self, rows: int, cache) -> bool:
        """Whether a fixed-shape step of `rows` one-token rows over `cache` runs its layers in the C++ stack
        (binding the weights if so), as _forward_fixed would decide now."""
        x = torch.empty(rows, 1, self.config.hidden_size, dtype=self.dtype, device=self.device)
        return self._native_stack(x, cache) is not None

    def _native_stack(self, x, cache) -> int | None:
        """The handle of the bound weights when this fixed-shape forward runs its layers in C++: one token a row
        on CPU, 1 to native.MAX_ROWS rows, float32/bfloat16 activations and cache. Eager calls bind first;
        code being compiled uses what bind_native_layers bound before tracing (the handle is a constant of
        the graph, and later bindings under it are seen by every step). Else None: the Python layers."""
        B, T, _ = x.shape
        if not (x.device.type == "cpu" and T == 1 and B <= native.MAX_ROWS and x.dtype in native.LAYER_DTYPES):
            return None
        if cache.keys[0].dtype != x.dtype or not NATIVE_LAYERS:
            return None
        if torch.compiler.is_compiling():
            return None if torch.is_grad_enabled() else self._native_bound
        with self.step_host.if_free() as free:
            # Another thread's compiled call holds the layout and what it bound: read that, rebind nothing.
            return self.bind_native_layers() if free else self._native_bound

    def _native_layers(self, x, cos, sin, cache, masks, slots, stack: int):
        B = x.shape[0]
        c = self.config
        layer_masks = [masks.get(layer.attn.window, masks.get(None)).reshape(B, -1) for layer in self.layers]
        h = torch.ops.decodekit.decode_layers(
            x.reshape(B, -1),
            cos.reshape(B, -1),
            sin.reshape(B, -1),
            slots,
            layer_masks,
            cache.keys,
            cache.values,
            stack,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.rms_norm_eps,
            cache.rows,
        )
        return h.view(B, 1, -1)
