"""Speculative decoding: assisted decoding (assistant_model=...; with assistant_tokenizer= and tokenizer= an assistant
of another vocabulary: universal assisted decoding), self-speculative decoding (assistant_early_exit=N: the model's
own first N layers draft) and prompt lookup (prompt_lookup_num_tokens=...).

A cheap source proposes several tokens; the target model scores them all in one forward pass and
keeps the longest prefix it agrees with, plus one token of its own. The result is the target's:
- greedy: a candidate is kept only if it is the target's argmax, so the output equals plain greedy;
- sampling with an assistant: candidate c drawn from the assistant's q is kept with probability
  min(1, p(c) / q(c)); at the first rejection a token is drawn from normalize(max(0, p - q)). This
  keeps the target's distribution p exactly (speculative sampling);
- sampling with prompt lookup (candidates without a distribution): a token is drawn from p at each
  position and candidates are kept while they equal the draw.
Rejected tokens leave both caches through the cache hook point's `crop`. One prompt at a time.
"""

from __future__ import annotations

import torch

from ..families.cache import cached_length, crop_to, record_past, recurrent, rolls_back
from ..core.config import is_int, is_number
from ..core.generate import forward_accepts
from ..core.outputs import loop_result
from ..core.rows import Rows
from ..core.tokens import common_prefix
from ..registry import hookimpl

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


@hookimpl
def decodekit_config_fields():
    return {
        "assistant_model": None,
        "num_assistant_tokens": 20,
        "num_assistant_tokens_schedule": "constant",
        "prompt_lookup_num_tokens": None,
        "max_matching_ngram_size": 2,
        "assistant_early_exit": None,
        "assistant_tokenizer": None,
        "assistant_confidence_threshold": 0.4,
        "assistant_lookbehind": 10,
        "target_lookbehind": 10,
        "is_assistant": False,
        "assistant_ensemble_weight": None,
    }


def _check_draft_fields(gc, context) -> None:
    """The fields that tune a draft, whichever drafts: confidence, lookbehinds, early exit, ensemble weight."""
    assistant, lookup, bad = gc.assistant_model, gc.prompt_lookup_num_tokens, gc.invalid
    threshold = gc.assistant_confidence_threshold
    if threshold is not None and (not is_number(threshold) or not 0 <= threshold <= 1):
        raise bad(
            "assistant_confidence_threshold",
            "expected a number in [0, 1] (0: draft num_assistant_tokens always) or None",
        )
    for name in ("assistant_lookbehind", "target_lookbehind"):
        if not is_int(getattr(gc, name)) or getattr(gc, name) < 1:
            raise bad(name, "expected an integer >= 1")
    if not isinstance(gc.is_assistant, bool):
        raise bad("is_assistant", "expected True or False")
    early = gc.assistant_early_exit
    if early is not None:
        layers = getattr(getattr(context.model, "config", None), "num_hidden_layers", None)
        if not is_int(early) or early < 1 or (context.model is not None and (layers is None or early >= layers)):
            raise bad(
                "assistant_early_exit",
                f"expected an integer in [1, {layers}) for this {layers}-layer model (the number of layers that draft)",
            )
        if assistant is not None or lookup is not None:
            raise ValueError(
                "assistant_early_exit drafts with the model itself; pass it without assistant_model and "
                "prompt_lookup_num_tokens."
            )
    weight = gc.assistant_ensemble_weight
    if weight is not None:
        if not is_number(weight) or not 0 < weight < 1:
            raise bad(
                "assistant_ensemble_weight",
                "expected a number in the open interval (0, 1), or None for lossless speculative decoding",
            )
        if (assistant is None and early is None) or gc.assistant_tokenizer is not None:
            raise ValueError(
                "assistant_ensemble_weight verifies against a mixture of the model's and the draft's "
                "distributions, so it needs a draft that has them: assistant_model (without "
                "assistant_tokenizer) or assistant_early_exit, not prompt lookup."
            )


@hookimpl
def decodekit_validate_config(generation_config, context):
    gc = generation_config
    assistant, lookup, early = gc.assistant_model, gc.prompt_lookup_num_tokens, gc.assistant_early_exit
    bad = gc.invalid
    _check_draft_fields(gc, context)
    _check_assistant_tokenizer(gc, context)
    if assistant is None and lookup is None and early is None:
        return
    if assistant is not None and lookup is not None:
        raise bad("prompt_lookup_num_tokens", "use either assistant_model or prompt_lookup_num_tokens, not both")
    if lookup is not None and (not is_int(lookup) or lookup < 1):
        raise bad("prompt_lookup_num_tokens", "expected an integer >= 1")
    if not is_int(gc.max_matching_ngram_size) or gc.max_matching_ngram_size < 1:
        raise bad("max_matching_ngram_size", "expected an integer >= 1")
    if not is_int(gc.num_assistant_tokens) or gc.num_assistant_tokens < 1:
        raise bad("num_assistant_tokens", "expected an integer >= 1")
    if gc.num_assistant_tokens_schedule not in SCHEDULES:
        raise bad("num_assistant_tokens_schedule", f"expected one of {list(SCHEDULES)}")
    if gc.number("num_beams", 1) > 1:
        raise bad("num_beams", "speculative decoding works with greedy decoding or sampling, not beam search")
    if context.batch_size != 1 or gc.number("num_return_sequences", 1) != 1:
        raise ValueError(
            f"speculative decoding (assistant_model / prompt_lookup_num_tokens) generates for one prompt at a time; "
            f"got batch size {context.batch_size} x num_return_sequences {gc.num_return_sequences}. Call it per prompt."
        )
    if assistant is not None:
        if not callable(assistant) or not hasattr(assistant, "config"):
            raise bad("assistant_model", "expected a model with the forward contract (e.g. from AutoModelForCausalLM)")
        ours, theirs = context.model.config.vocab_size, assistant.config.vocab_size
        if ours != theirs and gc.assistant_tokenizer is None:
            raise ValueError(
                f"assistant_model has a vocabulary of {theirs} tokens, the model {ours}: pass the two tokenizers "
                "(tokenizer= and assistant_tokenizer=) for universal assisted decoding, or use an assistant that "
                "shares the model's tokenizer."
            )


def _check_assistant_tokenizer(gc, context) -> None:
    if gc.assistant_tokenizer is None:
        return
    if gc.assistant_model is None:
        raise ValueError("assistant_tokenizer is the tokenizer of assistant_model; pass assistant_model too.")
    if context.tokenizer is None:
        raise ValueError(
            "universal assisted decoding (assistant_tokenizer=) needs the model's own tokenizer too: "
            "pass tokenizer= to generate()."
        )
    for name, tok in (("tokenizer", context.tokenizer), ("assistant_tokenizer", gc.assistant_tokenizer)):
        if not (callable(getattr(tok, "encode", None)) and callable(getattr(tok, "decode", None))):
            raise ValueError(
                f"{name} must be a tokenizer with encode(text, add_special_tokens=...) and decode(ids, "
                f"skip_special_tokens=...); got {type(tok).__name__}."
            )


@hookimpl
def decodekit_decoding_loop(generation_config):
    gc = generation_config
    drafted = gc.assistant_model is not None or gc.assistant_early_exit is not None
    return Speculative() if drafted or gc.prompt_lookup_num_tokens is not None else None


class EarlyExit:
    """The draft of self-speculative decoding (LayerSkip): the model's first `layers` layers, then its final norm
    and LM head, on the model's own cache (Speculative crops what it drafted there). decodekit's models stop after those layers (`exit_layer`); a transformers
    model runs with its config's num_hidden_layers lowered for the call, which the Llama-like ones read (others
    run every layer: still exact, only slower)."""

    def __init__(self, model, layers: int):
        import copy

        self.model, self.layers = model, layers
        self.config = copy.copy(model.config)
        self.config.num_hidden_layers = layers
        self.generation_config = model.generation_config.copy()  # the heuristic schedule writes to it
        self.device, self.dtype = model.device, model.dtype
        self.native = forward_accepts(model, "exit_layer")
        self.makes_caches = getattr(model, "makes_caches", False)
        if self.makes_caches:
            self.make_cache = model.make_cache

    def __call__(self, input_ids, **kwargs):
        if self.native:
            return self.model(input_ids, exit_layer=self.layers, **kwargs)
        config = self.model.config
        full = config.num_hidden_layers
        config.num_hidden_layers = self.layers
        try:
            return self.model(input_ids, **kwargs)
        finally:
            config.num_hidden_layers = full


class Translator:
    """The draft of universal assisted decoding: an assistant with a tokenizer of its own. Each round it reads
    the text of the target's tokens in its own tokens (its cache keeps what it read before: only the part that
    differs is fed), drafts greedily, and hands the drafted text over as the target's tokens of it, tokenized
    after the text of the target's last LOOKBEHIND tokens so that a word cut at the boundary tokenizes as the
    target would. The target verifies as for any candidates without a distribution, so greedy output is the
    target's own and sampling keeps its distribution."""

    def __init__(self, assistant, cache, assistant_tokenizer, tokenizer, lookbehind: int = 10):
        self.assistant, self.cache, self.theirs, self.ours = assistant, cache, assistant_tokenizer, tokenizer
        self.lookbehind = lookbehind  # target_lookbehind
        self.fed: list[int] = []  # the assistant tokens the cache holds
        self.ends = (
            set(assistant.generation_config.eos_token_ids or ()) if hasattr(assistant, "generation_config") else set()
        )

    def propose(self, input_ids: torch.LongTensor, n: int) -> torch.LongTensor:
        ids = self.theirs.encode(self.ours.decode(input_ids[0], skip_special_tokens=True))
        keep = common_prefix(self.fed, ids)
        keep = min(keep, len(ids) - 1)  # at least one token to feed
        crop_to(self.cache, keep)
        held, feed, drafted = ids[:keep], ids[keep:], []
        for _ in range(max(n, 0)):
            out = self.assistant(
                torch.tensor([feed], device=input_ids.device), past_key_values=self.cache, use_cache=True
            )
            held = held + feed
            token = int(out.logits[0, -1].argmax())
            if token in self.ends:
                break
            drafted.append(token)
            feed = [token]
        self.fed = held
        if not drafted:
            return input_ids[0, :0]
        tail = self.ours.decode(input_ids[0, -self.lookbehind :], skip_special_tokens=True)
        before = self.ours.encode(tail, add_special_tokens=False)
        after = self.ours.encode(tail + self.theirs.decode(drafted, skip_special_tokens=True), add_special_tokens=False)
        if after[: len(before)] != before:  # the boundary tokenizes differently: no guess this round
            return input_ids[0, :0]
        return torch.tensor(after[len(before) :][:n], dtype=torch.long, device=input_ids.device)


def prompt_lookup_candidates(ids: torch.Tensor, max_ngram: int, num_tokens: int, room: int) -> torch.Tensor:
    """Continues the longest n-gram (n <= max_ngram) at the end of `ids` [T] with what followed its first
    earlier occurrence: up to min(num_tokens, room) tokens; empty when nothing matches."""
    T = ids.shape[0]
    limit = min(num_tokens, room)
    for n in range(min(max_ngram, T - 1), 0, -1):
        windows = ids.unfold(0, n, 1)[:-1]  # every n-gram but the final one itself
        hits = (windows == ids[-n:]).all(dim=1).nonzero().flatten()
        for start in (hits + n).tolist():
            if start < T and limit > 0:
                return ids[start : min(start + limit, T)]
    return ids[:0]


def refuse_unless_rolls_back(cache, whose: str = "this model's cache") -> None:
    """ValueError where `cache` cannot be rolled back past rejected tokens (rolls_back is False). A cache with
    linear-attention layers says so only once it has read tokens: this is asked again before each roll-back."""
    if rolls_back(cache) is False:
        raise ValueError(
            f"speculative decoding rolls the cache back past rejected tokens, and {whose} "
            f"({type(cache).__name__}) holds recurrent states (a state-space or linear-attention layer) "
            "that cannot be rolled back: use greedy decoding, sampling or beam search."
        )


def refuse_what_cannot_roll_back(model, assistant, cache) -> None:
    """ValueError where speculative decoding could not roll back past rejected tokens: no cache, a model that keeps
    recurrent states in its own layers, a draft of the model's own first layers over linear-attention or recurrent
    layers, or a cache that cannot be cropped."""
    if cache is None:
        raise ValueError("speculative decoding needs use_cache=True: rejected tokens are cropped from the cache.")
    if getattr(model, "holds_recurrent_state", False):  # RecurrentGemma: its states are in its layers
        raise ValueError(
            f"speculative decoding rolls the model back past rejected tokens, and "
            f"{type(model.module).__name__} keeps recurrent states in its own layers, which cannot be "
            "rolled back: use greedy decoding, sampling or beam search."
        )
    if isinstance(assistant, EarlyExit) and recurrent(cache):
        raise ValueError(
            "self-speculative decoding (assistant_early_exit) drafts on the first layers of the "
            f"model's own cache, and this cache ({type(cache).__name__}) has linear-attention or "
            "recurrent layers, whose states record no length a draft could be cropped back to: use an "
            "assistant_model, prompt lookup, or greedy decoding."
        )
    refuse_unless_rolls_back(cache)


class Speculative:
    def rows_per_prompt(self, gc) -> int:
        return 1

    def __call__(self, model, input_ids, attention_mask, pipeline, gc, streamer, context):
        if attention_mask is not None:
            raise ValueError("speculative decoding needs an unpadded prompt (batch size 1, attention_mask all ones).")
        cache, max_length = pipeline.cache, context.max_length
        assistant, a_cache, translator = self._drafter(model, cache, gc, context, input_ids.device)
        keep_all = forward_accepts(model, "logits_to_keep")
        n_assist = gc.num_assistant_tokens
        if gc.num_assistant_tokens_schedule == "heuristic" and assistant is not None:
            n_assist = getattr(assistant.generation_config, "num_assistant_tokens", n_assist)
        scores_out = [] if gc.output_scores else None
        logits_out = [] if gc.output_logits else None
        progress = Rows(input_ids, gc, streamer)
        # The target's cache holds every token but the last, which the next forward feeds with the candidates.
        if input_ids.shape[1] > 1:
            model(
                input_ids[:, :-1], past_key_values=cache, use_cache=True, **({"logits_to_keep": 1} if keep_all else {})
            )
            refuse_unless_rolls_back(cache)  # a linear-attention layer tells only now
        done = False
        while not done:
            room = max_length - input_ids.shape[1] - 1  # candidates beyond this could never be kept
            drafter = (assistant, a_cache, translator)
            candidates, q = self._candidates(
                drafter, cache, input_ids, min(n_assist, room), room, pipeline, gc, context
            )
            K = candidates.shape[0]
            feed = torch.cat((input_ids[:, -1:], candidates[None]), dim=1)
            out = model(feed, past_key_values=cache, use_cache=True, **({"logits_to_keep": K + 1} if keep_all else {}))
            logits = out.logits[0, -(K + 1) :].float()
            kept = (scores_out, logits_out)
            step, accepted, done = self._verify(logits, input_ids, candidates, q, pipeline, gc, context, *kept)
            if assistant is not None and gc.num_assistant_tokens_schedule != "constant":
                n_assist = n_assist + 2 if accepted == K else max(1, n_assist - 1)
            refuse_unless_rolls_back(cache)  # (a one-token prompt: known after the first verification)
            if a_cache is not None and a_cache is not cache:
                refuse_unless_rolls_back(a_cache, "the assistant's cache")
            input_ids = torch.cat((input_ids, step), dim=1)
            for t in step[0]:
                progress.stream(t.view(1))
            # Keep what the target saw and agreed with: all but the newest token.
            crop_to(cache, input_ids.shape[1] - 1)
            if a_cache is not None and a_cache is not cache and translator is None:  # the translator crops its own
                crop_to(a_cache, min(cached_length(a_cache), input_ids.shape[1] - 1))
        if assistant is not None and gc.num_assistant_tokens_schedule == "heuristic":
            assistant.generation_config.num_assistant_tokens = n_assist  # carried to the next call, as transformers
        progress.end()
        return loop_result(gc, input_ids, cache, scores_out, logits_out)

    def _candidates(self, drafter, cache, input_ids, n: int, room: int, pipeline, gc, context):
        """(the draft's next candidate tokens [K], their distributions [K, V] or None where the draft has none):
        from the translator, the assistant, or prompt lookup."""
        assistant, a_cache, translator = drafter
        if translator is not None:
            return translator.propose(input_ids, n), None
        if assistant is not None:
            candidates, q = self._propose(assistant, a_cache, input_ids, n, pipeline, gc, context)
            if a_cache is cache:
                crop_to(cache, input_ids.shape[1] - 1)  # the draft's entries go; the target's forward writes them again
            return candidates, q
        return prompt_lookup_candidates(
            input_ids[0], gc.max_matching_ngram_size, gc.prompt_lookup_num_tokens, room
        ), None

    @staticmethod
    def _drafter(model, cache, gc, context, device):
        """(the assistant drafting candidates or None for prompt lookup, its cache, the translator between two
        tokenizers or None), each refused where it could not roll back past a rejected draft."""
        assistant = gc.assistant_model
        if gc.assistant_early_exit is not None:
            assistant = EarlyExit(model, gc.assistant_early_exit)
        refuse_what_cannot_roll_back(model, assistant, cache)
        record_past(cache)  # a sliding window keeps what a rejected draft would push out
        if isinstance(assistant, EarlyExit):
            # The draft's layers are the target's first layers: it drafts on the target's cache, whose entries for
            # those layers it would compute alike, and the drafted positions are cropped before the target verifies.
            return assistant, cache, None
        if assistant is None:
            return None, None, None
        from ..core.pipeline import GenerationContext
        from ..registry.manager import call_first

        a_context = GenerationContext(
            model=assistant,
            batch_size=1,
            prompt_length=context.prompt_length,
            max_length=context.max_length,
            device=device,
        )
        a_cache = call_first("decodekit_cache", generation_config=gc, context=a_context)[1]
        if a_cache is not None and rolls_back(a_cache) is False:
            raise ValueError(
                "the assistant's cache holds recurrent states (a state-space model), which cannot be "
                "rolled back past a rejected draft: use an attention-only assistant."
            )
        if a_cache is not None:
            record_past(a_cache)
        translator = None
        if gc.assistant_tokenizer is not None:
            translator = Translator(assistant, a_cache, gc.assistant_tokenizer, context.tokenizer, gc.target_lookbehind)
        return assistant, a_cache, translator

    def _verify(self, logits, input_ids, candidates, q, pipeline, gc, context, scores_out, logits_out):
        """The target's judgement of K candidates from its K + 1 logits rows: (the tokens kept [1, n], how many
        candidates were accepted, whether a stopping criterion ended the call). Each position's scores go through
        the call's processors; the first rejected candidate is replaced by the target's own token."""
        K = candidates.shape[0]
        accepted, new_tokens = 0, []
        for j in range(K + 1):
            prefix = torch.cat((input_ids, candidates[None, :j]), dim=1)
            raw = logits[j : j + 1]
            scores = pipeline.processors(prefix, raw.clone())
            token, keep = self._judge(scores, candidates, q, j, K, gc, context.generator)
            if logits_out is not None:
                logits_out.append(raw.clone())
            if scores_out is not None:
                scores_out.append(scores)
            new_tokens.append(token)
            if bool(pipeline.stopping(torch.cat((prefix, token.view(1, 1)), dim=1), scores).all()):
                return torch.stack(new_tokens).view(1, -1), accepted, True
            if not keep:
                break
            accepted += 1
        return torch.stack(new_tokens).view(1, -1), accepted, False

    @staticmethod
    def _judge(scores, candidates, q, j, K, gc, generator):
        """(the token to append at position j, whether the candidate there was accepted). With
        assistant_ensemble_weight w, a candidate is verified against v = w * p + (1 - w) * q instead of p (static
        ensemble verification, as transformers): greedy keeps it where it is v's argmax, sampling with probability
        min(1, v(c) / q(c)); the token after the last candidate is p's alone."""
        w = gc.assistant_ensemble_weight
        ensemble = w is not None and j < K and q is not None
        if not gc.do_sample:
            if ensemble:
                token = (w * torch.softmax(scores, dim=-1)[0] + (1 - w) * q[j]).argmax()
            else:
                token = scores.argmax(dim=-1)[0]
            return token, j < K and bool(token == candidates[j])
        p = torch.softmax(scores, dim=-1)[0]
        if j < K and q is not None:
            c = candidates[j]
            u = _uniform((), p, generator)
            target = w * p[c] + (1 - w) * q[j, c] if ensemble else p[c]
            if bool(u * q[j, c] <= target):  # accept with probability min(1, target(c) / q(c))
                return c, True
            # (v - q)+ is w * (p - q)+: the same distribution once normalised
            residual = (p - q[j]).clamp(min=0)
            total = residual.sum()
            tiny = torch.finfo(residual.dtype).tiny if ensemble else 0
            dist = residual / total if bool(total > tiny) else p
            return _draw(dist, generator), False
        token = _draw(p, generator)
        return token, j < K and bool(token == candidates[j])

    @staticmethod
    def _propose(assistant, a_cache, input_ids, n, pipeline, gc, context):
        """Up to n tokens from the assistant (greedy or sampled), and for sampling their distributions q [n, V]. The
        draft stops early after a token the assistant gave a probability below assistant_confidence_threshold, as
        transformers' ConfidenceCriteria: the target would likely reject what follows."""
        tokens, qs = [], []
        threshold = gc.assistant_confidence_threshold or 0
        ids = input_ids
        for _ in range(max(n, 0)):
            fresh = ids[:, cached_length(a_cache) :] if a_cache is not None else ids
            out = assistant(fresh, past_key_values=a_cache, use_cache=a_cache is not None)
            scores = pipeline.processors(ids, out.logits[:, -1, :].float())
            if gc.do_sample:
                q = torch.softmax(scores, dim=-1)[0]
                token = _draw(q, context.generator)
                qs.append(q)
            else:
                token = scores.argmax(dim=-1)[0]
                if gc.assistant_ensemble_weight is not None:  # greedy verification mixes in the draft's q
                    qs.append(torch.softmax(scores, dim=-1)[0])
            tokens.append(token)
            ids = torch.cat((ids, token.view(1, 1)), dim=1)
            if threshold and float(torch.softmax(scores[0], dim=-1)[token]) < threshold:
                break
        candidates = torch.stack(tokens) if tokens else input_ids[0, :0]
        return candidates, (torch.stack(qs) if qs else None)


def _draw(probs: torch.Tensor, generator) -> torch.Tensor:
    """One token from `probs` [V] by the exponential race (see SamplingSelector), its noise drawn from
    `generator` in order: the draft and the check draw a varying number of times a step."""
    noise = _uniform(probs.shape, probs, generator).log_().neg_()
    return (probs / noise).argmax()


def _uniform(shape, like: torch.Tensor, generator) -> torch.Tensor:
    """Uniforms in [0, 1) drawn from `generator` on its own device (a caller's generator may be the CPU's while the
    model is on a GPU), in `like`'s dtype and on its device."""
    where = generator.device if generator is not None else like.device
    return torch.rand(shape, generator=generator, device=where, dtype=like.dtype).to(like.device)
