"""Real templates of several model families (read from the patched tree's models/templates) on tiny
models whose vocabularies hold the families' special tokens as control or user-defined tokens:
thinking plus text forced by a grammar without tools, one tool call and two parallel calls forced
by ``tool_choice`` through the chat layer's own grammar, each plain and streamed, parsed by
llama.cpp's chat layer into ``reasoning_content``, ``content`` and ``tool_calls``. A last assistant
message is continued, as llama-server continues it. Greedy output with MTP drafting equals the
output without, under those grammars."""

import json

import numpy as np
import pytest

from llama_metaws import Llama
from llama_metaws.native.binding import llama_cpp
from llama_metaws.native.runtime import require_build
from llama_metaws_dev.testing import make_tiny_model, make_tiny_mtp_model
from llama_metaws.demo.vocab import CHAT_FAMILIES
from llama_metaws_dev.testing.chat_tools import TIME, WEATHER

TEMPLATES = require_build().src_dir / "models" / "templates"

#: template -> the vocabulary family it needs
FAMILIES = {
    "Qwen3.5-4B.jinja": "qwen",
    "Qwen-Qwen3-0.6B.jinja": "qwen",
    "Qwen3-Coder.jinja": "qwen",
    "Qwen-QwQ-32B.jinja": "qwen",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3",
    "llama-cpp-deepseek-r1.jinja": "deepseek",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "qwen",
}
#: the families whose templates think (a reasoning block the layer extracts)
THINKING = {"Qwen3.5-4B.jinja", "Qwen-Qwen3-0.6B.jinja", "Qwen-QwQ-32B.jinja", "llama-cpp-deepseek-r1.jinja"}

#: how each template's format goes to its calls: the tokens that come first in order (closing a
#: thinking block its generation prompt leaves open, opening a block of calls), the token that
#: opens each call, the one that closes the block
STEER = {"meta-llama-Llama-3.1-8B-Instruct.jinja": {"first": ['{"'], "call": '{"', "close": None},
         "llama-cpp-deepseek-r1.jinja": {"first": ["</think>", "<\uff5ctool\u2581calls\u2581begin\uff5c>"],
                                         "call": "<\uff5ctool\u2581call\u2581begin\uff5c>",
                                         "close": "<\uff5ctool\u2581calls\u2581end\uff5c>",
                                         # inside a call: the grammar would let '<' begin them
                                         # in characters, which this vocabulary cannot finish
                                         "within": ["<\uff5ctool\u2581sep\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"]}}
STEER_DEFAULT = {"first": ["<tool_call>"], "call": "<tool_call>", "close": None}
EOGS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<\uff5cend\u2581of\u2581sentence\uff5c>")
ASK = [{"role": "user", "content": "Weather in Paris?"}]
REASONING, ANSWER = "thinking it over", "Paris is sunny."


@pytest.fixture(scope="module")
def family_models(models_dir):
    return {f: make_tiny_model(models_dir / f"chat-{f}.gguf", vocab=f"chat-{f}", seed=3)
            for f in ("qwen", "llama3", "deepseek")}


@pytest.fixture(scope="module")
def llms(family_models):
    opened = {}

    def get(template: str) -> Llama:
        if template not in opened:
            opened[template] = Llama(str(family_models[FAMILIES[template]]), n_ctx=4096, n_batch=512,
                                     verbose=False, chat_template=(TEMPLATES / template).read_text())
        return opened[template]

    yield get
    for llm in opened.values():
        llm.close()


def assemble(chunks):
    """A stream's message from its deltas; each tool call's id and name come once."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for c in chunks:
        if not c["choices"]:
            continue
        choice = c["choices"][0]
        delta = choice["delta"]
        msg["content"] += delta.get("content") or ""
        msg["reasoning_content"] += delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls", []):
            call = msg["tool_calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None, "a tool call's id came twice"
                call["id"] = tc["id"]
            fn = tc.get("function", {})
            if "name" in fn:
                assert call["name"] is None, "a tool call's name came twice"
                call["name"] = fn["name"]
            call["arguments"] += fn.get("arguments", "")
        finish = choice["finish_reason"] or finish
    msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return msg, finish


def flat(res):
    """A non-streamed answer's message in :func:`assemble`'s shape, and its finish reason."""
    m = res["choices"][0]["message"]
    calls = [{"id": tc["id"], "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
             for tc in m.get("tool_calls", [])]
    return {"content": m["content"] or "", "reasoning_content": m.get("reasoning_content", ""),
            "tool_calls": calls}, res["choices"][0]["finish_reason"]


def chat(llm, stream: bool, **kw):
    res = llm.create_chat_completion(stream=stream, temperature=0, **kw)
    return assemble(list(res)) if stream else flat(res)


def no_ids(msg):
    return dict(msg, tool_calls=[{k: v for k, v in c.items() if k != "id"} for c in msg["tool_calls"]])


def thinking_grammar(llm, template: str) -> str:
    """A grammar for ``REASONING`` then ``ANSWER``: the thinking block opened unless the template's
    generation prompt opens it."""
    templates = llm._chat_templates
    from llama_metaws.api.chat_layer import chat_request

    params = chat_request(templates, ASK).applied(templates)
    opened = params.generation_prompt.rstrip("\n").endswith("<think>")
    text = ("" if opened else "<think>\n") + f"{REASONING}\n</think>\n\n{ANSWER}"
    return "root ::= " + json.dumps(text)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_thinking_and_text_forced_by_a_grammar(llms, template, stream):
    llm = llms(template)
    msg, finish = chat(llm, stream, messages=ASK, grammar=thinking_grammar(llm, template), max_tokens=96)
    assert finish == "stop"
    assert msg["tool_calls"] == []
    if template in THINKING:
        # the layer keeps the newlines around </think> in some formats (llama-server answers so too)
        assert (msg["reasoning_content"].strip("\n"), msg["content"].strip("\n")) == (REASONING, ANSWER)
    else:  # no thinking in this family's format: the text is content, as the layer leaves it
        assert msg["reasoning_content"] == "" and msg["content"].endswith(ANSWER)
        assert REASONING in msg["content"]


def single_token(llm, text: str) -> int:
    """The id of the vocabulary's token whose text is ``text``."""
    ids = [i for i in range(llm.n_vocab()) if llm._model.token_get_text(i) == text]
    assert len(ids) == 1, (text, ids)
    return ids[0]


class Steer:
    """A tiny model's random text would not end a thinking block, begin a call, or make just
    ``n_calls`` calls by itself: this logits processor plays a model that knows its format a
    little (:data:`STEER`). It favours the tokens that come first, then each call's opening
    token until ``n_calls`` calls are open (the end of generation ruled out until then), then
    the block's closing token; after an opening token, a newline (JSON formats open a call with
    ``<tool_call>\n``: without it the tag is content). The chat layer's grammar, applied after
    it, decides what may come."""

    def __init__(self, llm, template: str, n_calls: int = 1):
        plan = STEER.get(template, STEER_DEFAULT)
        self.first = [single_token(llm, t) for t in plan["first"]]
        self.call = single_token(llm, plan["call"])
        self.close = single_token(llm, plan["close"]) if plan["close"] else None
        self.within = [single_token(llm, t) for t in plan.get("within", [])]
        self.newline, self.eos, self.n_calls, self.n_prompt = single_token(llm, "<0x0A>"), llm.token_eos(), n_calls, None

    def __call__(self, input_ids, scores):
        if self.n_prompt is None:
            self.n_prompt = len(input_ids)
        out = [int(t) for t in input_ids[self.n_prompt:]]
        scores = scores.copy()
        scores[self.within] += 40.0
        todo = [t for t in self.first if t not in out]
        calls = out.count(self.call)
        if calls < self.n_calls:
            scores[self.eos] = -np.inf
        if out and out[-1] in self.first + [self.call]:
            scores[self.newline] += 60.0
        elif todo:
            scores[todo[0]] += 50.0
        elif calls < self.n_calls:
            scores[self.call] += 50.0
        elif self.close is not None:
            scores[self.close] += 50.0
        return scores


def tool_kwargs(llm, template: str, n_calls: int = 1) -> dict:
    """No thinking (the template's switch), :class:`Steer`, and the end-of-generation token
    favoured above all once allowed, the family's other end tokens ruled out."""
    spec = CHAT_FAMILIES[FAMILIES[template]]
    held = set(spec["control"]) | set(spec["user"])
    eos = llm.token_eos()
    bias = {eos: 100.0}
    for text in EOGS:
        if text in held:
            bias[single_token(llm, text)] = -100.0
    return {"chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 200, "logit_bias": bias,
            "logits_processor": llama_cpp.LogitsProcessorList([Steer(llm, template, n_calls)])}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_one_tool_call_forced_by_a_named_tool_choice(llms, template, stream):
    llm = llms(template)
    msg, finish = chat(llm, stream, messages=ASK, tools=[WEATHER, TIME],
                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       **tool_kwargs(llm, template))
    assert finish == "tool_calls"
    assert [c["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert json.loads(msg["tool_calls"][0]["arguments"]) in ({"hot": True}, {"hot": False})
    assert msg["tool_calls"][0]["id"]
    if not stream:  # the stream's deltas make up the same message
        again, finish2 = chat(llm, True, messages=ASK, tools=[WEATHER, TIME],
                              tool_choice={"type": "function", "function": {"name": "get_weather"}},
                              **tool_kwargs(llm, template))
        assert (no_ids(again), finish2) == (no_ids(msg), finish)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_two_parallel_tool_calls_forced_by_a_required_tool_choice(llms, template, stream):
    llm = llms(template)
    parallel = llm._chat_templates.caps["supports_parallel_tool_calls"]
    msg, finish = chat(llm, stream, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                       parallel_tool_calls=True, **tool_kwargs(llm, template, 2 if parallel else 1))
    assert finish == "tool_calls"
    if not parallel:  # Llama 3.1's format has one call per answer: the layer's grammar allows no second
        assert len(msg["tool_calls"]) == 1, msg
        return
    assert len(msg["tool_calls"]) == 2, msg
    for call in msg["tool_calls"]:
        args = json.loads(call["arguments"])
        assert call["name"] in ("get_weather", "get_time") and call["id"]
        assert args in ({"hot": True}, {"hot": False}, {"utc": True}, {"utc": False})
    assert msg["tool_calls"][0]["id"] != msg["tool_calls"][1]["id"]
    # without parallel_tool_calls the layer's grammar stops after one (where the format says so)
    one, _ = chat(llm, stream, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False, **tool_kwargs(llm, template, 1))
    assert len(one["tool_calls"]) == 1


def test_a_tool_result_and_reasoning_go_back_to_the_template(llms):
    llm = llms("Qwen3.5-4B.jinja")
    from llama_metaws.api.chat_layer import chat_request

    turn = ASK + [{"role": "assistant", "content": "", "reasoning_content": "I should call it",
                   "tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prompt = chat_request(llm._chat_templates, turn, tools=[WEATHER]).applied(llm._chat_templates).prompt
    assert "I should call it" in prompt  # the last assistant turn's reasoning, as the template keeps it
    assert "<function=get_weather>" in prompt and "<parameter=city>\nParis" in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_last_assistant_message_is_continued_as_llama_server_continues_it(llms, stream):
    """``Llama.create_chat_completion`` as llama-server's chat: a last assistant message is
    continued (prefill_assistant, on by default; ``continue_final_message``), the thinking block
    closed, the answer's content that message and what follows; a stream's deltas leave the
    message out only where continue_final_message asked for it; llama-server's refusals."""
    from llama_metaws.errors import ChatLayerError

    llm = llms("Qwen3.5-4B.jinja")
    prefilled = ASK + [{"role": "assistant", "content": "Paris is"}]
    sunny = 'root ::= " sunny."'  # a request's grammar: what follows the message
    for kw, content in (({}, "Paris is sunny."), ({"continue_final_message": True, "add_generation_prompt": False},
                                                  " sunny." if stream else "Paris is sunny.")):
        msg, finish = chat(llm, stream, messages=prefilled, grammar=sunny, max_tokens=16, **kw)
        assert (msg["content"], msg["reasoning_content"], finish) == (content, "", "stop")
    with pytest.raises(ChatLayerError, match="Cannot set both add_generation_prompt and continue_final_message"):
        chat(llm, stream, messages=prefilled, continue_final_message=True, max_tokens=2)
    with pytest.raises(ChatLayerError, match="Cannot have 2 or more assistant messages at the end"):
        chat(llm, stream, messages=prefilled + [{"role": "assistant", "content": "sunny"}], max_tokens=2)


@pytest.fixture(scope="module")
def mtp_model(models_dir):
    return make_tiny_mtp_model(models_dir / "chat-qwen-mtp.gguf", vocab="chat-qwen", seed=5)


@pytest.mark.parametrize("case", ["thinking-grammar", "named-tool", "lazy-auto", "json-schema"])
def test_greedy_output_with_mtp_drafting_equals_the_output_without(mtp_model, case):
    src = (TEMPLATES / "Qwen3.5-4B.jinja").read_text()
    out = {}
    for draft in (None, "mtp"):
        with Llama(str(mtp_model), n_ctx=4096, verbose=False, chat_template=src, draft=draft, draft_max=3) as llm:
            kw = {"messages": ASK, "max_tokens": 64, "temperature": 0}
            if case == "thinking-grammar":
                kw["grammar"] = "root ::= " + json.dumps(f"{REASONING}\n</think>\n\n{ANSWER}")
            elif case == "named-tool":
                kw.update(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                          **tool_kwargs(llm, "Qwen3.5-4B.jinja"))
            elif case == "lazy-auto":  # a lazy grammar: free text, constrained once <tool_call> appears
                steer = tool_kwargs(llm, "Qwen3.5-4B.jinja")
                kw.update(tools=[WEATHER], chat_template_kwargs={"enable_thinking": False},
                          logits_processor=steer["logits_processor"])
            else:
                kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "w", "schema": {
                    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
                kw["chat_template_kwargs"] = {"enable_thinking": False}
            res = llm.create_chat_completion(**kw)
            out[draft] = (no_ids(flat(res)[0]), res["choices"][0]["finish_reason"], res["usage"])
            if draft == "mtp":
                assert llm.draft_stats.last.drafted > 0  # it did draft
    assert out["mtp"] == out[None]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_reasoning_budget_ends_the_thinking_block_as_llama_server_forces_it(llms, stream):
    """Qwen3.5's generation prompt opens <think>: with a budget of N, the sampler forces the
    budget message and the end tag after N tokens of thinking (the random model would think on)."""
    llm = llms("Qwen3.5-4B.jinja")
    for budget, message in ((0, ""), (3, "Ok.")):
        msg, finish = chat(llm, stream, messages=ASK, max_tokens=24, reasoning_budget_tokens=budget,
                           reasoning_budget_message=message)
        assert finish in ("stop", "length")
        thought = msg["reasoning_content"].rstrip("\n")  # the end tag's newline stays (as the layer cuts)
        assert thought.endswith(message)
        n = len(llm.tokenize(thought[: len(thought) - len(message)].encode(), add_bos=False, special=True))
        assert n <= budget, (budget, thought)
    unbounded, _ = chat(llm, stream, messages=ASK, max_tokens=24)  # without a budget it thinks on
    assert len(llm.tokenize(unbounded["reasoning_content"].encode(), add_bos=False, special=True)) > 3
