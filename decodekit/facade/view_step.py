"""The compiled decode step under TransformersView: a Hub method's own loop, asked to compile (generate(...,
compile=True)), runs each of its one-token forwards as one compiled step of the native module, as
generate(compile=True) does (CUDA graphs on a GPU).

The method keeps its transformers Cache and every call it makes on it; the step runs over a static cache of its own
(core/compile.FusedStep: fixed shapes, fixed addresses) that mirrors the method's cache:
- a DynamicCache's layers are handed back as views of the step's buffers ([:, :, :length]), so after the first step
  nothing is copied: the step writes the new position in place, and the method's crop (a shorter view of the same
  memory) keeps the two in step;
- a StaticCache keeps its own buffers: the step's new position is written to them through the cache's own update().
A change the method makes that the step cannot follow in place (reorder_cache, batch_select_indices, an eager
forward's concatenation) gives its layers other memory; the next step sees that (each layer's address, the length
it knows) and copies the cache into its buffers once. Only one cache is mirrored by a step at a time: another
cache of the same thread taking the step first gets back memory of its own for what the step held for it; a cache
of another thread's method runs the plain forward while the first one lives.

What runs eagerly, with one logged reason per call and kind: prefill and multi-token forwards, a cache of another
class (a method's own subclass, a sliding-window layer), hidden states asked for, inputs_embeds, a step that does not
compile. Why a mirror rather than decodekit cache classes handed to the method: docs/architecture.md.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from .. import kernels
from ..core.compile import FusedStep
from ..core.fused_loop import bucket, fixed_step_logits, supports_step
from ..core.transfer import to_device

logger = logging.getLogger("decodekit")

# transformers' cache and layer classes the step mirrors, by name: the same in every transformers 5.x.
MIRRORED_CACHES = {"DynamicCache": "DynamicLayer", "StaticCache": "StaticLayer"}


# A call's prompt always runs eagerly, so this reason is told only for a call none of whose forwards was a step.
SEVERAL_TOKENS = (
    "every forward of the call ran several tokens a row or over an empty cache (the prompt, whole sequences, "
    "verifications); the step runs one new token a row over a cache"
)


class MirroredStep(FusedStep):
    """A method's compiled step: a FusedStep whose static cache mirrors one transformers cache at a time (`mirror`),
    its buffers taken by one thread's forward at a time (`lock`)."""

    def __init__(self, module, rows: int, capacity: int, options: dict | None):
        super().__init__(module, rows, capacity, options, one_token_forward)
        self.mirror: Mirror | None = None
        self.lock = threading.Lock()


class ViewCompile:
    """The decode steps of one call of a method on a TransformersView: the torch.compile `options` of its steps
    (None: the same step, run eagerly: a method's tokens then do not depend on compile=), the call's hold on the
    model's StepHost (the weight layout it holds from its first step to its end) and the reasons a forward ran as the
    view's plain forward instead (logged once each, when compiling). The caches this call's steps mirrored are its
    own (`mirrors`), given memory of their own again at `close()`, when the method returns."""

    def __init__(self, module, options: dict | None, method: str):
        self.module, self.options, self.method = module, options, method
        # What the options add to a step's key, made once: decode() asks for its step at every token.
        self.options_key = None if options is None else tuple(sorted((k, repr(v)) for k, v in options.items()))
        self.host = kernels.StepHost.of(module)
        self.call_hold = self.host.call_hold(module)
        self.bound_rows: int | None = None
        self.mirrors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> the Mirror that holds it
        self.told: set[str] = set()
        self.stepped = self.several = False

    def close(self) -> None:
        # A step outlives the call (the host keeps it for the next): the caches it mirrored stop viewing its buffers.
        for cache, mirror in list(self.mirrors.items()):
            if mirror.step.mirror is mirror:
                mirror.release(cache)
                mirror.step.mirror = None
        self.mirrors.clear()
        self.call_hold.close()
        self.bound_rows = None
        if self.several and not self.stepped and not self.told:
            self.tell(SEVERAL_TOKENS)

    def eager_because(self, reason: str) -> None:
        if reason == SEVERAL_TOKENS:
            self.several = True  # told at close(), where no forward was a step and no other reason was told
        else:
            self.tell(reason)

    def tell(self, reason: str) -> None:
        if self.options is not None and reason not in self.told:
            self.told.add(reason)
            logger.info("custom_generate %s: a forward runs eagerly (not compiled): %s", self.method, reason)

    def refusal(self, cache, input_ids, inputs_embeds, output_hidden_states, length: int, past: int) -> str | None:
        """Why this forward of `length` tokens a row over `past` cached positions cannot be a compiled step (None: it
        can). The reasons a whole call's forwards may share (DoLa's and SLED's are all several tokens a row and ask
        for hidden states) come first, so such a call is told why once."""
        if not supports_step(self.module, "fused"):
            return f"{type(self.module).__name__} does not declare a fused step (steps_supported)"
        if inputs_embeds is not None or input_ids is None:
            return "it passes inputs_embeds"
        if output_hidden_states:
            return "it asks for hidden states (output_hidden_states=True)"
        if cache is None:
            return "it runs without a cache (use_cache=False)"
        if length != 1 or past == 0:
            return SEVERAL_TOKENS
        kind = type(cache).__name__
        layer = MIRRORED_CACHES.get(kind)
        if layer is None or type(cache).__module__.split(".")[0] != "transformers":
            return f"its cache is a {type(cache).__qualname__}; the step mirrors transformers' DynamicCache and StaticCache"
        if len(cache.layers) != len(self.module.layers):  # a method removed or added one: the plain forward says so
            return f"its {kind} holds {len(cache.layers)} layers, the model {len(self.module.layers)}"
        if any(type(entry).__name__ != layer for entry in cache.layers):
            kinds = sorted({type(entry).__name__ for entry in cache.layers})
            return f"its {kind} holds {', '.join(kinds)} layers; the step mirrors {layer}s"
        return None

    def step_for(self, rows: int, capacity: int) -> MirroredStep | None:
        """The compiled step for `rows` one-token rows over `capacity` cache slots (made at first use), with the
        model's weights in that step's layout; None where it failed to compile before, where another thread's call
        holds the model's weight layout (refused once, the call runs the plain forward to its end: one path for all
        of its tokens) or on a thread the method started."""
        refused = self.call_hold.refused
        layout = self.call_hold.hold(rows)
        if layout is None:
            if self.call_hold.refused and not refused:
                self.tell("another thread's call holds the model's weight layout for its own steps")
            return None
        if self.bound_rows != rows and self.module.device.type == "cpu":
            self.module.bind_native_layers()  # after the layout for these rows is in force
        self.bound_rows = rows
        key = self.step_key(rows, capacity)

        def make() -> MirroredStep:
            if self.options is not None:
                logger.info(
                    "custom_generate %s: compiling the decode step (%d rows, %d cache slots)",
                    self.method,
                    rows,
                    capacity,
                )
            return MirroredStep(self.module, rows, capacity, self.options)

        return self.host.step("method decode", key, make)

    def step_key(self, rows: int, capacity: int) -> tuple:
        """What the StepHost keeps this call's step for `rows` rows and `capacity` slots under (the layout held)."""
        return (rows, capacity, self.options_key, self.call_hold.key)

    def mirror_of(self, cache) -> Mirror | None:
        """The Mirror that took `cache` into a step's buffers in this call, if any."""
        return self.mirrors.get(cache)

    def decode(self, cache, input_ids, attention_mask, position_ids, past: int):
        """The logits [rows, 1, vocab] of one token per row over `cache` (a transformers Cache holding `past`
        positions), computed by the compiled step, the cache updated as its own update() would; None where the step
        did not compile (the caller runs the forward eagerly)."""
        if attention_mask is not None and attention_mask.shape[-1] < past + 1:
            return None  # a mask short of the cache: the plain forward says what it takes
        rows = input_ids.shape[0]
        capacity = bucket(past + 1)
        step = self.step_for(rows, capacity)
        if step is None:
            return None
        dev = input_ids.device
        mask = torch.zeros(rows, step.cache.max_cache_len, dtype=torch.long, device=dev)
        mask[:, : past + 1] = attention_mask[:, -(past + 1) :] if attention_mask is not None else 1
        if position_ids is None:
            position_ids = torch.full((rows, 1), past, dtype=torch.long, device=dev)
        slots = to_device([past], torch.long, dev)  # not waiting for the device, as torch.tensor(..., device=) would
        with step.lock:
            if not Mirror.free_for(step, cache):
                return None
            self.mirrors[cache] = Mirror.serve(step, cache, past)
            try:
                # A method's one-token inputs are often views of a longer sequence: the compiled code takes them dense.
                logits = step(input_ids.contiguous(), position_ids.contiguous(), slots, mask)
            except torch._dynamo.exc.TorchDynamoException as error:
                what = f"custom_generate {self.method}: a forward runs eagerly (not compiled): the step did not compile"
                key = self.step_key(rows, capacity)
                self.host.failed("method decode", key, error, what, redo=step.compiles and not step.compiled_once)
                return None
            step.mirror.written(cache, past)
        self.stepped = True
        return logits


def one_token_forward(module, cache):
    """The function FusedStep compiles: one token per row at slot `slots` of `cache`, the logits as the module gives
    them (its dtype), [rows, 1, vocab]."""

    def step(tokens, positions, slots, mask):
        return fixed_step_logits(module, tokens, mask, positions, cache, slots)

    return step


class Mirror:
    """Which transformers cache a step's buffers hold (`owner`, weakly), how many positions of it they hold
    (`length`), and the memory each of its layers was in when they did (`addresses`)."""

    def __init__(self, step: MirroredStep, owner):
        self.step, self.owner, self.length, self.addresses = step, weakref.ref(owner), 0, []
        self.thread = threading.get_ident()

    @staticmethod
    def free_for(step: MirroredStep, cache) -> bool:
        """Whether `cache` may take `step`'s buffers now: they hold nothing, or `cache`, or a cache no longer alive,
        or one of this thread's. A cache of another thread's method keeps them (that thread may be reading its views
        of them or changing its layers at this moment); `cache` then runs the plain forward."""
        mirror = step.mirror
        if mirror is None or mirror.thread == threading.get_ident():
            return True
        owner = mirror.owner()
        return owner is None or owner is cache

    @staticmethod
    def serve(step: MirroredStep, cache, past: int) -> Mirror:
        """Makes `step`'s buffers hold the first `past` positions of `cache`, and returns the Mirror that says so:
        nothing to do where they already do, else one copy (the step's previous cache, if another, first gets memory
        of its own)."""
        mirror = step.mirror
        owner = mirror.owner() if mirror is not None else None
        if owner is cache and mirror.holds(cache, past):
            return mirror
        if owner is not None and owner is not cache:
            mirror.release(owner)
        step.mirror = mirror = Mirror(step, cache)
        buffers = step.cache
        for layer, keys, values in zip(cache.layers, buffers.keys, buffers.values):
            keys[:, :, :past].copy_(layer.keys[:, :, :past])
            values[:, :, :past].copy_(layer.values[:, :, :past])
        mirror.held(cache, past)
        return mirror

    @staticmethod
    def layer_addresses(cache) -> list:
        return [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.keys.shape[0]) for layer in cache.layers]

    def holds(self, cache, past: int) -> bool:
        # crop() shortens a layer's view of the same memory; anything else gives it other memory (or other rows).
        return past <= self.length and self.layer_addresses(cache) == self.addresses

    def written(self, cache, past: int) -> None:
        """After a step wrote position `past` into the buffers: the cache holds it too."""
        if type(cache).__name__ != "DynamicCache":  # a StaticCache keeps its own buffers: in through its update()
            for index, (keys, values) in enumerate(zip(self.step.cache.keys, self.step.cache.values)):
                cache.update(keys[:, :, past : past + 1], values[:, :, past : past + 1], index)
        self.held(cache, past + 1)

    def held(self, cache, length: int) -> None:
        """The buffers hold `cache`'s first `length` positions: a DynamicCache's layers become views of them."""
        if type(cache).__name__ == "DynamicCache":
            for layer, keys, values in zip(cache.layers, self.step.cache.keys, self.step.cache.values):
                layer.keys, layer.values = keys[:, :, :length], values[:, :, :length]
        self.length = length
        self.addresses = self.layer_addresses(cache)

    def stale_from(self, past: int) -> None:
        """An eager forward is about to write the owner's positions from `past` on, which the buffers do not see."""
        self.length = min(self.length, past)

    def release(self, cache) -> None:
        """The step's buffers go to another cache: `cache`'s layers that are views of them get their own memory."""
        buffers = self.step.cache
        for layer, keys in zip(cache.layers, buffers.keys):
            if layer.keys.data_ptr() == keys.data_ptr():
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()


class Incremental:
    """A cacheless method's state (it calls model(input_ids) on the whole sequence every step): the sequence, mask
    and cache of the previous call and the logits of every position so far, so a call that extends that sequence
    runs only its new positions. `logits` is a buffer [rows, capacity, vocab], its first `length` positions
    filled."""

    def __init__(self, input_ids, attention_mask, cache, logits):
        self.ids, self.mask, self.cache = input_ids, attention_mask, cache
        self.length = input_ids.shape[1]
        self.addresses = Mirror.layer_addresses(cache)
        capacity = bucket(self.length + 1)
        self.logits = logits.new_empty(logits.shape[0], capacity, logits.shape[2])
        self.logits[:, : self.length] = logits

    def extended_by(self, input_ids, attention_mask) -> bool:
        """Whether this call's sequence is the previous one with new positions after it, the same rows and mask,
        and the kept cache still as the previous call left it."""
        n = self.length
        if input_ids.shape[0] != self.ids.shape[0] or input_ids.shape[1] <= n:
            return False
        if (attention_mask is None) != (self.mask is None):
            return False
        if attention_mask is not None and not torch.equal(attention_mask[:, :n], self.mask):
            return False
        if int(self.cache.get_seq_length()) != n or Mirror.layer_addresses(self.cache) != self.addresses:
            return False  # the method changed the cache the previous call returned (crop, reorder, ...)
        return torch.equal(input_ids[:, :n], self.ids)

    def extend(self, input_ids, attention_mask, logits) -> torch.Tensor:
        """Keeps the new positions' `logits`; returns every position's, [rows, length, vocab]."""
        end = input_ids.shape[1]
        if end > self.logits.shape[1]:
            grown = self.logits.new_empty(self.logits.shape[0], bucket(2 * end), self.logits.shape[2])
            grown[:, : self.length] = self.logits[:, : self.length]
            self.logits = grown
        self.logits[:, self.length : end] = logits
        self.ids, self.mask, self.length = input_ids, attention_mask, end
        self.addresses = Mirror.layer_addresses(self.cache)
        return self.logits[:, :end]
