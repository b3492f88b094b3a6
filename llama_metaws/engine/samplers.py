"""A request's sampler: llama.cpp's sampler chain, built as the binding builds it.

Each request gets its own chain (``llama_sampler_chain``) with the request's parameters, grammar
and seed, in the order ``llama_cpp.Llama`` assembles it (its ``_init_sampler``), so that a request
samples on the engine exactly what it samples on the binding: a Python logits processor first
(as a custom sampler), the repetition penalties, the grammar, then greedy (``temp == 0``), plain
``dist`` (``temp < 0``), mirostat 1 or 2, or top-k, typical, top-p, min-p, temperature and dist.
``sample`` is ``llama_sampler_sample`` (apply, select, accept) on one output row of a context.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import GrammarError
from ..native.binding import _internals, llama_cpp
from . import sampling as _sampling

__all__ = ["SamplingParams", "SlotSampler", "GrammarError", "ChatGrammar", "ReasoningBudget"]

#: the binding's default for penalty_last_n (llama_cpp.Llama's last_n_tokens_size)
PENALTY_LAST_N = 64


@dataclasses.dataclass
class ChatGrammar:
    """A grammar as llama-server's sampler takes a chat's (``common_sampler_init``): lazy until
    one of its triggers (``common_grammar_trigger``s as the chat layer gives them) appears, or
    eager; the chat layer's own eager grammar (``prefill``) first accepts the generation prompt
    the template ended the prompt with. ``preserved``: the preserved tokens' ids (a trigger word
    that is one token must be one of them)."""

    text: str
    lazy: bool = False
    triggers: Sequence[dict] = ()
    preserved: Sequence[int] = ()
    generation_prompt: str = ""
    prefill: bool = False

    def sampler(self, vocab):
        """A new grammar sampler (a ``llama_sampler *`` as an int address) for ``vocab``."""
        import json

        from ..native.shim import address, check_error, ffi, lib

        _sampling.check_grammar(self.text, vocab)  # the depth and size limits, llama.cpp's message
        out = ffi.new("struct llama_sampler **")
        kept = ffi.new("llama_token[]", [int(t) for t in self.preserved] or [0])
        check_error(lib.lmws_chat_grammar_init(
            ffi.cast("struct llama_vocab *", address(vocab)), self.text.encode("utf-8"), bool(self.lazy),
            json.dumps(list(self.triggers)).encode("utf-8"), kept, len(self.preserved),
            self.generation_prompt.encode("utf-8"), bool(self.prefill), out))
        return int(ffi.cast("uintptr_t", out[0]))


@dataclasses.dataclass
class ReasoningBudget:
    """llama-server's reasoning budget for a chat (``--reasoning-budget``): once ``budget`` tokens
    of the thinking block (opened by ``start``, the generation prompt counting) have gone by, the
    sampler forces ``message`` and the first of ``ends``."""

    start: str
    ends: Sequence[str]
    budget: int
    message: str = ""
    generation_prompt: str = ""

    def sampler(self, vocab):
        """A new budget sampler (a ``llama_sampler *`` as an int address) for ``vocab``."""
        import json

        from ..native.shim import address, check_error, ffi, lib

        out = ffi.new("struct llama_sampler **")
        check_error(lib.lmws_reasoning_budget_init(
            ffi.cast("struct llama_vocab *", address(vocab)), self.start.encode("utf-8"),
            json.dumps(list(self.ends)).encode("utf-8"), self.message.encode("utf-8"), int(self.budget),
            self.generation_prompt.encode("utf-8"), out))
        return int(ffi.cast("uintptr_t", out[0]))


@dataclasses.dataclass
class SamplingParams:
    """``llama_cpp.Llama.generate``'s sampling arguments, and the request's seed."""

    temp: float = 0.80
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    mirostat_mode: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    penalty_last_n: int = PENALTY_LAST_N
    seed: int = 0xFFFFFFFF
    grammar: Optional[object] = None                 # a llama_cpp.LlamaGrammar or a ChatGrammar
    logits_processor: Optional[Sequence[Callable]] = None  # f(input_ids, logits) -> logits
    reasoning_budget: Optional[ReasoningBudget] = None  # a chat's, applied before the grammar

    @property
    def greedy(self) -> bool:
        """The chain takes the argmax of the logits as they come (no processor, no grammar)."""
        return (self.temp == 0.0 and not self.logits_processor and self.grammar is None
                and self.reasoning_budget is None
                and self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0)


class SlotSampler:
    """One request's llama.cpp sampler chain. ``history()`` gives a Python logits processor the
    tokens before the position being sampled (the binding's ``input_ids``)."""

    def __init__(self, model, n_vocab: int, params: SamplingParams,
                 history: Callable[[], np.ndarray]) -> None:
        self.params = params
        self._chain = chain = _internals.LlamaSampler()
        p = params
        if p.logits_processor:
            processors = list(p.logits_processor)

            def apply(token_data_array) -> None:
                data = token_data_array.contents
                view = np.ctypeslib.as_array(
                    (llama_cpp.llama_token_data * data.size).from_address(
                        ctypes.addressof(data.data.contents)))
                logits = view["logit"]
                ids = history()
                for f in processors:
                    logits[:] = f(ids, logits)

            chain.add_custom(apply)
        self._penalties = llama_cpp.llama_sampler_chain_n(chain.sampler)  # its index in the chain
        chain.add_penalties(n_vocab=n_vocab, penalty_last_n=p.penalty_last_n, penalty_repeat=p.repeat_penalty,
                            penalty_freq=p.frequency_penalty, penalty_present=p.presence_penalty)
        if p.reasoning_budget is not None:
            _add_native(chain, p.reasoning_budget.sampler(model.vocab))
        if p.grammar is not None:
            _add_grammar(chain, model, p.grammar)
        if p.temp < 0.0:
            chain.add_dist(p.seed)
        elif p.temp == 0.0:
            chain.add_greedy()
        elif p.mirostat_mode == 1:
            chain.add_mirostat(n_vocab, p.seed, p.mirostat_tau, p.mirostat_eta, 100)
        elif p.mirostat_mode == 2:
            chain.add_mirostat_v2(p.seed, p.mirostat_tau, p.mirostat_eta)
        else:
            chain.add_top_k(p.top_k)
            chain.add_typical(p.typical_p, 1)
            chain.add_top_p(p.top_p, 1)
            chain.add_min_p(p.min_p, 1)
            chain.add_temp(p.temp)
            chain.add_dist(p.seed)

    def accept_prompt(self, prompt: Sequence[int]) -> None:
        """The prompt's tokens into the penalties' window (its last ``penalty_last_n``), as
        llama-server accepts them before the first token and the binding's penalties read its
        input ids: a repeated prompt token is penalized. Not into the grammar nor the reasoning
        budget, which start at the first generated token."""
        p = self.params
        if p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
            return  # no penalty: nothing reads the window
        last = len(prompt) if p.penalty_last_n < 0 else p.penalty_last_n
        penalties = llama_cpp.llama_sampler_chain_get(self._chain.sampler, self._penalties)
        for token in list(prompt)[max(0, len(prompt) - last):] if last else []:
            llama_cpp.llama_sampler_accept(penalties, int(token))

    def sample(self, ctx, idx: int) -> int:
        """Sample the output row of batch index ``idx`` of ``ctx`` (a ``llama_context_p``) and
        accept the token into the chain (grammar, penalties, mirostat state). What llama.cpp
        throws, or a grammar that rules out every token, is an exception for this request
        (:mod:`.sampling`), never the end of the process."""
        return _sampling.sample(self._chain.sampler, ctx, idx)

    def accept(self, token: int) -> None:
        """Tell the chain a token was taken without sampling it (a token the caller sent)."""
        _sampling.accept(self._chain.sampler, int(token))

    def select(self, ctx, idx: int) -> int:
        """:meth:`sample` without the accept (the caller accepts the token it takes)."""
        return _sampling.select(self._chain.sampler, ctx, idx)

    def accept_draft(self, token: int) -> None:
        """A synthetic draft token taken: the chain accepts it, its grammar and reasoning budget do not."""
        _sampling.accept_draft(self._chain.sampler, int(token))

    def close(self) -> None:
        if self._chain is not None:
            self._chain.close()
            self._chain = None


def _add_native(chain, sampler: int) -> None:
    """Add a sampler the shim made (its address) to the chain, which owns it from then on."""
    llama_cpp.llama_sampler_chain_add(chain.sampler, ctypes.cast(sampler, llama_cpp.llama_cpp.llama_sampler_p_ctypes))


def _add_grammar(chain, model, grammar) -> None:
    if isinstance(grammar, ChatGrammar):
        _add_native(chain, grammar.sampler(model.vocab))
        return
    text = getattr(grammar, "_grammar", None)
    root = getattr(grammar, "_root", "root")
    if not isinstance(text, str):
        raise GrammarError(f"not a grammar: {grammar!r}")
    _sampling.check_grammar(text, model.vocab, root)  # llama.cpp's parse message, as an exception
    sampler = llama_cpp.llama_sampler_init_grammar(model.vocab, text.encode("utf-8"), root.encode("utf-8"))
    if not sampler:  # llama.cpp logs the parse error; a NULL in the chain would crash it
        raise GrammarError("llama.cpp could not parse the grammar (its log says where)")
    llama_cpp.llama_sampler_chain_add(chain.sampler, sampler)
