"""The agreement design: where each NextN head's greedy draft agrees with the target's next token.

The token-level plan (what the target continues with, what each head drafts) and the three
kinds of tensors that carry it, for any width and any number of heads. The qwen35 builder
(:func:`llama_metaws_dev.testing.make_tiny_mtp_model`) and every family builder draw it the same
way, so the same seed gives the same plan.

* ``token_embd`` rows ``e_t`` are orthonormal (QR of a seeded Gaussian): every norm maps
  ``e_t`` to ``sqrt(E) * e_t``, and every branch writes tiny values, so the last hidden state of
  the target after ``x`` is ``~sqrt(E) * e_x`` whatever the context.
* ``output`` row ``succ(t)`` is ``(LOGIT_MARGIN / sqrt(E)) * e_t``: the target walks a seeded
  cycle through every token but the last (the end of generation, never chosen).
* head k's ``eh_proj = [M_k | 0]`` with ``M_k e_t = e_pi_k(t)``: it reads the token half only and
  drafts ``succ(pi_k(x))``; ``pi_k(x) = x`` on its agreeing tokens, ``succ(x)`` elsewhere (the
  draft then guesses two tokens ahead, always wrong). Along the cycle, position j agrees iff
  ``floor((j+1) a_k) > floor(j a_k)``: any 64 steps agree at rate ``a_k`` within 2/64.

In a chained draft head k gets the token head k-1 drafted: every head reads the same kind of
input, so a per-head rate (``agreement=[1.0, 0.0, 0.0]``) makes a probe whose later heads are
always wrong.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple, Union

import numpy as np

#: Logit gap between the designed next token and every other token.
LOGIT_MARGIN = 10.0

Agreement = Union[float, Sequence[float]]


def check_agreement(agreement: Agreement, n_heads: int) -> List[float]:
    """One rate per head: a float applies to every head."""
    rates = [agreement] * n_heads if isinstance(agreement, (int, float)) else list(agreement)
    if len(rates) != n_heads:
        raise ValueError(f"agreement has {len(rates)} rates for {n_heads} NextN heads")
    out = []
    for a in rates:
        a = float(a)
        if not (0.0 <= a <= 1.0) or a != a:
            raise ValueError(f"agreement must be a float in [0, 1] (or one per head), got {agreement!r}")
        out.append(a)
    return out


def agreement_plan(rng: np.random.Generator, n_vocab: int, n_embd: int,
                   rates: Sequence[float]) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
    """Draw the embedding basis and the successor cycle; return (plan, embeddings).

    ``plan``: ``cycle`` (the tokens but the last, in successor order), ``succ`` (the target's
    greedy next token), and per head k ``agree``/``pi``/``draft`` (head 0's under those names,
    every head's as lists under ``heads_agree``, ``heads_pi``, ``heads_draft``). Draws exactly
    a QR of an ``E x V`` Gaussian and one permutation, whatever the number of heads.
    """
    V, E = n_vocab, n_embd
    if V > E:
        raise ValueError(f"the agreement design needs orthonormal embeddings: n_vocab {V} > n_embd {E}")
    eos = V - 1
    q, _ = np.linalg.qr(rng.standard_normal((E, V)))  # E x V, orthonormal columns
    emb = np.ascontiguousarray(q.T)  # V x E, orthonormal rows
    # the last token ends generation: the cycle leaves it out, so greedy decoding never ends on
    # its own; after it (a prompt may hold it) comes the cycle's first token
    cycle = rng.permutation(V - 1).astype(np.int64)
    succ = np.empty(V, dtype=np.int64)
    succ[cycle] = np.roll(cycle, -1)
    succ[eos] = cycle[0]
    j = np.arange(V - 1, dtype=np.int64)
    agrees, pis, drafts = [], [], []
    for a in rates:
        on_cycle = (np.floor((j + 1) * a + 1e-9) > np.floor(j * a + 1e-9)).astype(np.int64)
        agree = np.ones(V, dtype=np.int64)
        agree[cycle] = on_cycle
        pi = np.where(agree == 1, np.arange(V), succ)
        agrees.append(agree)
        pis.append(pi)
        drafts.append(succ[pi])
    plan = {"cycle": cycle, "succ": succ, "agree": agrees[0], "draft": drafts[0], "pi": pis[0],
            "heads_agree": agrees, "heads_pi": pis, "heads_draft": drafts}
    return plan, emb


def design_tensors(plan: Dict[str, np.ndarray], emb: np.ndarray) -> Dict[str, object]:
    """``token_embd``, ``output`` and each head's ``eh_proj`` (numpy shapes) for ``plan``."""
    V, E = emb.shape
    eos = V - 1
    scale = LOGIT_MARGIN / np.sqrt(E)
    # row succ(t) = scale * e_t; the end-of-generation row stays zero (never chosen), and the
    # row after it also answers to e_EOS
    output = np.zeros((V, E))
    cycle = plan["cycle"]
    output[plan["succ"][cycle]] = scale * emb[cycle]
    output[plan["succ"][eos]] += scale * emb[eos]
    eh_proj = []
    for pi in plan["heads_pi"]:
        m = emb[pi].T @ emb  # M @ e_t = e_pi(t)
        proj = np.zeros((E, 2 * E))
        proj[:, :E] = m  # the token half; the hidden half stays zero
        eh_proj.append(proj)
    return {"token_embd": emb, "output": output, "eh_proj": eh_proj}
