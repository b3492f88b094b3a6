"""The second table of ``llama-metaws vram``: host-resident KV under tensor split, with the MTP draft and the workspace.

``llama-metaws vram --host-kv`` runs one configuration in a child process: tensor split with
``offload_kqv=False`` (llama.cpp's ``-nkvo``: the target's and the draft's KV caches in host
memory, each device working on its own KV heads of them; patches 0014-0016), ``draft="mtp"``, the
alias workspace, and three requests: a short prompt, a prompt near the context size (of a
sequence: ``n_ctx / n_seq_max``, as llama.cpp's slots get it), a short follow-up. It reports, from ggml's accounting (llama.cpp's memory
breakdown, ``plan.memory_breakdown``), the exact bytes per buffer type of the target's KV cache
(its context bytes in host buffer types), its recurrent state (its context bytes in the others:
the meta device) and the draft's KV cache; and per request the result, prompt and decode tokens/s
and the draft acceptance.
"""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional, Sequence

from ..children import find_assert, run_child

#: the follow-up request's text (the first two take ``prompt``)
FOLLOW_UP = "and what happened next?"


def request_lengths(n_ctx_seq: int, n_predict: int, draft_max: int) -> List[int]:
    """Prompt lengths of the three requests: short, near a sequence's context (``n_ctx / n_seq_max``),
    short again."""
    near = n_ctx_seq - n_predict - draft_max - 2
    short = max(1, min(64, n_ctx_seq // 8))
    if near <= short:
        raise ValueError(f"a sequence's context of {n_ctx_seq} leaves no room for a prompt near it with -n {n_predict}")
    return [short, near, max(1, short // 4)]


def _tokens(llm, text: str, n: int) -> List[int]:
    toks = list(llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)) or [1]
    return [toks[i % len(toks)] for i in range(n)]


def _memory(llm) -> dict:
    from ..plan import memory_breakdown

    out = {"target KV": {}, "recurrent state": {}, "draft KV": {}}
    for ctx, host_key, other_key in ((llm._ctx, "target KV", "recurrent state"), (llm._draft_ctx, "draft KV", None)):
        for e in memory_breakdown(ctx).values():
            key = host_key if e["host"] or other_key is None else other_key
            if e["context"]:
                out[key][e["name"]] = out[key].get(e["name"], 0) + e["context"]
    return out


def _child(req: dict) -> dict:
    import llama_metaws  # noqa: F401  (the patched build, before llama_cpp)
    from ...api.llama import Llama

    n_ctx, n_predict, draft_max = int(req["n_ctx"]), int(req["n_predict"]), int(req["draft_max"])
    lengths = request_lengths(n_ctx // int(req["n_seq_max"]), n_predict, draft_max)
    kw = dict(draft="mtp", draft_max=draft_max, devices=list(req["devices"]), split_mode="tensor",
              offload_kqv=False, n_seq_max=int(req["n_seq_max"]), n_ctx=n_ctx, n_batch=n_ctx,
              n_ubatch=int(req["n_ubatch"]), phase_aware_workspace=req["workspace_mode"] != "off",
              workspace_mode=req["workspace_mode"] if req["workspace_mode"] != "off" else "alias",
              use_mmap=not req.get("no_mmap"), verbose=False)
    if req.get("threads"):
        kw["n_threads"] = kw["n_threads_batch"] = int(req["threads"])
    llm = Llama(req["model"], **kw)
    try:
        out = {"memory": _memory(llm), "requests": []}
        prompts = [_tokens(llm, req["prompt"], lengths[0]), _tokens(llm, req["prompt"], lengths[1]),
                   _tokens(llm, FOLLOW_UP, lengths[2])]
        for name, toks in zip(("short prompt", "prompt near the context size", "short follow-up"), prompts):
            row = {"request": f"{name} ({len(toks)} tokens)", "prompt_tokens": len(toks)}
            try:
                res = llm.create_completion(toks, max_tokens=n_predict, temperature=0.0)
                t = llm.timings()
                row.update(result="ok", completion_tokens=res["usage"]["completion_tokens"],
                           prompt_tokens_per_s=t["prompt_tokens_per_s"], tokens_per_s=t["decode_tokens_per_s"],
                           draft_acceptance=llm.draft_stats.last.acceptance if llm.draft_stats.last.drafted else None)
            except (RuntimeError, ValueError) as e:
                row.update(result="error", message=f"{type(e).__name__}: {e}")
            out["requests"].append(row)
        return out
    finally:
        llm.close()


def run_host_kv(*, model: str, devices: Sequence[str], prompt: str, n_ctx: int = 512, n_ubatch: int = 64,
                n_predict: int = 32, draft_max: int = 3, n_seq_max: int = 2, workspace_mode: str = "alias",
                no_mmap: bool = False, threads: Optional[int] = None, timeout: float = 600) -> dict:
    """The configuration in a child process: ``{name, result, message, memory, requests}``.

    ``memory``: ``{"target KV" | "recurrent state" | "draft KV": {buffer type: bytes}}``;
    ``requests``: ``{request, result, prompt_tokens, completion_tokens, prompt_tokens_per_s,
    tokens_per_s, draft_acceptance}`` each. ``result`` is ``"ok"``, ``"refused"`` (a ValueError
    before loading: the configuration cannot run on these devices), ``"assert"`` or ``"error"``.
    """
    req = dict(model=os.fspath(model), devices=list(devices), prompt=prompt, n_ctx=n_ctx, n_ubatch=n_ubatch,
               n_predict=n_predict, draft_max=draft_max, n_seq_max=n_seq_max, workspace_mode=workspace_mode,
               no_mmap=no_mmap, threads=threads)
    name = f"host KV (-nkvo), tensor split {','.join(devices)}, draft-mtp, {workspace_mode} workspace"
    record = {"name": name, "result": "ok", "message": "", "memory": {}, "requests": []}
    child = run_child([sys.executable, "-m", "llama_metaws.tools.vram.hostkv"], input=json.dumps(req), timeout=timeout)
    lines = [ln for ln in (child.stdout or "").splitlines() if ln.startswith("{")]
    if child.returncode == 0 and lines:
        record.update(json.loads(lines[-1]))
        bad = [r for r in record["requests"] if r["result"] != "ok"]
        if bad:
            record.update(result="error", message=bad[0]["message"])
        return record
    tail = [ln for ln in (child.stderr or "").strip().splitlines() if ln.strip()]
    if child.returncode is None:
        record.update(result="error", message=f"timed out after {timeout:g} s")
    elif find_assert(child.stderr):
        record.update(result="assert", message=find_assert(child.stderr))
    elif tail and tail[-1].startswith("REFUSED: "):
        record.update(result="refused", message=tail[-1][len("REFUSED: "):])
    else:
        record.update(result="error", message=tail[-1] if tail else f"exit status {child.returncode}")
    return record


def format_host_kv(record: dict) -> str:
    """The host-KV table: bytes per buffer type, then one line per request."""
    lines = [f"{record['name']}: {record['result']}" + (f" ({record['message']})" if record["message"] else "")]
    mem = [(what, buft, b) for what, per in record.get("memory", {}).items() for buft, b in per.items()]
    rows = [("memory (ggml's accounting)", "buffer type", "bytes", "")]
    rows += [(what, buft, f"{b:,} B", f"{b / 2**20:.2f} MiB") for what, buft, b in mem]
    rows += [("", "", "", ""), ("request", "result", "prompt t/s", "decode t/s", "draft acceptance")]
    for r in record.get("requests", []):
        ok = r["result"] == "ok"
        rows.append((r["request"], r["result"] if ok else f"{r['result']}: {r.get('message', '')}",
                     f"{r['prompt_tokens_per_s']:.1f}" if ok and r.get("prompt_tokens_per_s") else "-",
                     f"{r['tokens_per_s']:.1f}" if ok and r.get("tokens_per_s") else "-",
                     f"{r['draft_acceptance']:.1%}" if ok and r.get("draft_acceptance") is not None else "-"))
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(5)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def main() -> int:
    """The child: a request as JSON on stdin, the record's figures as one JSON line on stdout."""
    req = json.load(sys.stdin)
    try:
        out = _child(req)
    except ValueError as e:  # refused before loading: the message names the option
        print(f"REFUSED: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # a clean failure: reported, not an abort
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["FOLLOW_UP", "format_host_kv", "request_lengths", "run_host_kv"]
