"""Sampling that fails one request, never the process.

llama.cpp's sampling throws C++ exceptions where a request asks for what the model cannot give,
and a C++ exception that reaches ctypes ends the process (``std::terminate``). The shim's
``native/sampler.cpp`` does the same steps with the checks in between and catches what is
thrown; these are its Python side, for :class:`~llama_metaws.api.llama.Llama` and any engine:

- :func:`check_grammar`: parse a GBNF grammar as llama.cpp does; :class:`GrammarError` with
  llama.cpp's parse message (``llama_sampler_init_grammar`` only returns NULL and prints why);
- :func:`sample`: ``llama_sampler_sample``'s steps (apply the chain to a row of logits, take the
  selected token, accept it) with a check that some token is left: :class:`GrammarError` when
  every token is ruled out (the grammar allows none of the vocabulary, where llama.cpp would
  accept one anyway and throw), :class:`SamplingError` when llama.cpp threw;
- :func:`accept`: accept a token the caller chose (a draft, a forced token), asking the chain's
  grammars first whether they allow it; :func:`select` samples without accepting, and
  :func:`accept_draft` accepts a synthetic draft token past the grammars (synthetic acceptance);
- :class:`CheckedSampler`: the binding's ``LlamaSampler`` whose ``sample`` and ``accept`` are
  these.

Grammars are nested deeply only by mistake or malice, and llama.cpp's parser and its stack
advance recurse once per level (a group, a rule naming a rule): on an 8 MiB thread stack 20,000
nested groups or 100,000 chained rules overflow it, which no exception handler catches.
:func:`check_grammar` refuses a grammar nesting groups deeper than :data:`MAX_GRAMMAR_DEPTH` or
with more than :data:`MAX_GRAMMAR_RULES` rules before llama.cpp sees it.
"""

from __future__ import annotations

from typing import Optional

from ..errors import GrammarError, SamplingError
from ..native.binding import _internals
from ..native.shim import address, check_error, ffi, lib

__all__ = ["check_grammar", "sample", "select", "accept", "accept_draft", "CheckedSampler", "GrammarError",
           "SamplingError", "MAX_GRAMMAR_DEPTH", "MAX_GRAMMAR_RULES", "grammar_depth"]

#: Groups a grammar may nest, and rules it may have (a chain of rules is recursion too): far
#: below what overflows a thread's stack (see the module docstring), far above what JSON
#: schemas and tool calls produce.
MAX_GRAMMAR_DEPTH = 256
MAX_GRAMMAR_RULES = 4096


def grammar_depth(text: str) -> int:
    """How deeply a GBNF text nests groups ``( ... )``: outside literals, classes and comments."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":  # a literal or a class: skip to its end, escapes included
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":  # a comment, to the end of the line
            while i < n and text[i] not in "\r\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def _n_rules(text: str) -> int:
    """An upper bound of the rules a GBNF text defines (one per line with ``::=``)."""
    return sum(1 for line in text.splitlines() if "::=" in line)


def check_grammar(text: str, vocab=None, root: str = "root") -> None:
    """Parse ``text`` as llama.cpp would; :class:`GrammarError` (a ``ValueError``) if it cannot.

    ``vocab``: the model's ``llama_vocab *`` (``Llama.check_grammar`` passes it), needed for
    grammars that name tokens (``<[123]>``, ``<think>``); without one such a grammar fails.
    """
    if not isinstance(text, str):
        raise GrammarError(f"the grammar must be a string, got {type(text).__name__}")
    depth = grammar_depth(text)
    if depth > MAX_GRAMMAR_DEPTH:
        raise GrammarError(f"the grammar nests groups {depth} deep; at most {MAX_GRAMMAR_DEPTH} are allowed")
    if _n_rules(text) > MAX_GRAMMAR_RULES:
        raise GrammarError(f"the grammar has more than {MAX_GRAMMAR_RULES} rules")
    if "\x00" in text or "\x00" in root:
        raise GrammarError("the grammar contains a NUL character")
    check_error(lib.lmws_grammar_check(ffi.cast("struct llama_vocab *", address(vocab)),
                                       text.encode("utf-8"), root.encode("utf-8")))


def _sampler_ptr(sampler):
    return ffi.cast("struct llama_sampler *", address(sampler))


def sample(sampler, ctx, idx: int = -1) -> int:
    """Sample a token at output ``idx`` of ``ctx`` through ``sampler`` (a chain) and accept it.

    ``sampler`` and ``ctx``: ``llama_sampler *`` and ``llama_context *`` (ctypes pointers, cffi
    pointers or addresses). :class:`GrammarError` when no token is left (nothing is accepted),
    :class:`SamplingError` when llama.cpp threw, ``IndexError`` when ``ctx`` has no logits there.
    """
    out = ffi.new("llama_token *")
    check_error(lib.lmws_sampler_sample(_sampler_ptr(sampler), ffi.cast("struct llama_context *", address(ctx)),
                                        int(idx), out))
    return int(out[0])


def select(sampler, ctx, idx: int = -1) -> int:
    """:func:`sample` without the accept: the caller accepts the token it takes (with
    :func:`accept`, or :func:`accept_draft`)."""
    out = ffi.new("llama_token *")
    check_error(lib.lmws_sampler_select(_sampler_ptr(sampler), ffi.cast("struct llama_context *", address(ctx)),
                                        int(idx), out))
    return int(out[0])


def accept_draft(sampler, token: int) -> None:
    """Accept a synthetic draft token as llama-server does (``common_sampler_accept`` with
    ``is_generated`` false): every sampler of the chain takes it but its grammars and reasoning
    budget, which see only what the target samples."""
    check_error(lib.lmws_sampler_accept_draft(_sampler_ptr(sampler), int(token)))


def accept(sampler, token: int) -> None:
    """Accept ``token`` into ``sampler`` (a chain or one sampler): :class:`GrammarError` when a
    grammar of it does not allow the token (nothing is accepted), :class:`SamplingError` when
    llama.cpp threw."""
    check_error(lib.lmws_sampler_accept(_sampler_ptr(sampler), int(token)))


class CheckedSampler(_internals.LlamaSampler):
    """The binding's ``LlamaSampler`` whose :meth:`sample` and :meth:`accept` cannot end the
    process. :meth:`adopt` turns a chain the binding built into one."""

    @classmethod
    def adopt(cls, sampler: Optional[_internals.LlamaSampler]):
        if sampler is not None and type(sampler) is _internals.LlamaSampler:
            sampler.__class__ = cls  # the same object: its chain, custom samplers and cleanup
        return sampler

    def sample(self, ctx, idx: int = -1) -> int:
        return sample(self.sampler, ctx.ctx, idx)

    def accept(self, token: int) -> None:
        accept(self.sampler, token)
