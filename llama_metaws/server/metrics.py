"""``GET /metrics``: Prometheus text with llama-server's names, and the workspace's gauges.

llama-server's families: its counters (prompt tokens evaluated and, apart, those kept from an
earlier request, tokens predicted, their seconds, decode calls, the most tokens a slot held,
drafts) and gauges (prompt and generation tokens per second over the requests so far, requests
processing and deferred, busy slots per decode); the route adds its ``Process-Start-Time-Unix``
header."""

from __future__ import annotations

from typing import List, Tuple


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def render(worker) -> str:
    c = worker.counters.read()
    steps = c.engine.get("steps", 0)
    families: List[Tuple[str, str, str, list]] = [
        ("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.",
         [("", c.prompt_tokens)]),
        ("llamacpp:prompt_tokens_cached_total", "counter",
         "Number of prompt tokens kept from an earlier request (not evaluated again).",
         [("", c.prompt_tokens_cached)]),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt process time.", [("", c.prompt_seconds)]),
        ("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.",
         [("", c.tokens_predicted)]),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time.",
         [("", c.tokens_predicted_seconds)]),
        ("llamacpp:requests_total", "counter", "Requests that ran on the model.", [("", c.requests)]),
        ("llamacpp:n_decode_total", "counter", "Total number of llama_decode() calls (target batches).",
         [("", steps)]),
        ("llamacpp:n_tokens_max", "counter", "Largest observed n_tokens (the most tokens a slot held).",
         [("", c.n_tokens_max)]),
        ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         [("", _rate(c.prompt_tokens, c.prompt_seconds))]),
        ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
         [("", _rate(c.tokens_predicted, c.tokens_predicted_seconds))]),
        ("llamacpp:n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call.",
         [("", c.engine.get("busy_slot_steps", 0) / steps if steps else 0.0)]),
        ("llamacpp:spec_decode_num_drafts_total", "counter",
         "Draft steps verified by the target (MTP drafting).", [("", c.drafts)]),
        ("llamacpp:spec_decode_num_draft_tokens_total", "counter", "Tokens drafted.",
         [("", c.draft_tokens)]),
        ("llamacpp:spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens accepted.",
         [("", c.draft_accepted)]),
        ("llamacpp:requests_processing", "gauge", "Number of requests processing.",
         [("", worker.processing)]),
        ("llamacpp:requests_deferred", "gauge", "Number of requests deferred (waiting).",
         [("", worker.deferred)]),
        ("llamametaws:draft_length_steps_total", "counter",
         "Steps by the draft length they asked for (0: a plain decode step).",
         [(f'{{length="{k}"}}', v) for k, v in sorted(c.draft_lengths.items())]),
        ("llamametaws:shadow_drafts_total", "counter",
         "draft_max=auto's scouts drafted on the side of a plain step (not verified, not in the draft tokens).",
         [("", c.shadow_drafts)]),
        ("llamametaws:plain_steps_share", "gauge", "The share of steps that drafted nothing.",
         [("", (c.draft_lengths.get(0, 0) / sum(c.draft_lengths.values())) if c.draft_lengths else 0.0)]),
        ("llamametaws:slots", "gauge", "The engine's slots (-np): requests served at once.",
         [("", worker.n_parallel)]),
        ("llamametaws:slots_busy_max", "gauge", "The most slots busy in one engine step so far.",
         [("", c.engine.get("slots_busy_max", 0))]),
        ("llamametaws:steps_total", "counter", "Engine steps (one target batch each).",
         [("", c.engine.get("steps", 0))]),
        ("llamametaws:graphs_target_total", "counter", "Graphs (ubatches) the target computed.",
         [("", c.engine.get("graphs_target", 0))]),
        ("llamametaws:graphs_draft_total", "counter", "Graphs the MTP draft context computed.",
         [("", c.engine.get("graphs_draft", 0))]),
    ]
    mode = getattr(worker.llm, "workspace_mode", None)
    families.append(("llamametaws:workspace_enabled", "gauge",
                     "1 when the target and its MTP draft context share a phase-aware workspace (the mode in "
                     "the label).", [(f'{{mode="{_escape(mode or "none")}"}}', int(mode is not None))]))
    ws = {name: [] for name in ("bytes", "owner_need_bytes", "borrower_need_bytes", "generation",
                                "grows_total", "shrinks_total", "alias_in_use", "shared")}
    for i, e in enumerate(c.workspace):
        labels = (f'{{entry="{i}",buffer_type="{_escape(e.buffer_type)}",device="{_escape(e.device)}"}}')
        ws["bytes"].append((labels, e.allocated))
        ws["owner_need_bytes"].append((labels, e.owner_need))
        ws["borrower_need_bytes"].append((labels, e.borrower_need))
        ws["generation"].append((labels, e.generation))
        ws["grows_total"].append((labels, e.n_grow))
        ws["shrinks_total"].append((labels, e.n_shrink))
        ws["alias_in_use"].append((labels, int(bool(e.alias))))
        ws["shared"].append((labels, int(bool(e.shared))))
    about = {
        "bytes": ("gauge", "Compute bytes allocated for this buffer type (a shared entry once, for both)."),
        "owner_need_bytes": ("gauge", "The target's published compute requirement."),
        "borrower_need_bytes": ("gauge", "The draft's published compute requirement."),
        "generation": ("gauge", "Replacements of this buffer's memory."),
        "grows_total": ("counter", "Times the shared buffer grew."),
        "shrinks_total": ("counter", "Times the shared buffer shrank."),
        "alias_in_use": ("gauge", "1 when the draft computes through a meta-buffer alias."),
        "shared": ("gauge", "1 for an entry shared by the target and the draft."),
    }
    for key, samples in ws.items():
        kind, text = about[key]
        families.append((f"llamametaws:workspace_{key}", kind, text, samples))
    lines = []
    for name, kind, text, samples in families:
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value}")
    return "\n".join(lines) + "\n"
