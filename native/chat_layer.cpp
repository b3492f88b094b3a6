// llama-metaws shim, C++ side: llama.cpp's chat layer (common/chat.h) behind C calls, JSON in and
// JSON out, so that chats are rendered, constrained and parsed exactly as llama-server does it.
//
// Every call catches what the chat layer throws (a template that does not parse or render,
// messages or tools it cannot read, a schema it cannot turn into a grammar, a parser that meets
// text it cannot take) and returns LMWS_ECHAT with the exception's text (lmws_last_error), so a
// C++ exception never reaches cffi, which would end the process. The calls that llama.cpp would
// GGML_ASSERT on are checked first.
//
// Strings returned through `char ** out` are malloc'ed; the caller frees them with
// lmws_chat_free_string. Python's side is llama_metaws/api/chat_layer.py, the one module of ours
// that calls these.
#include "shim.h"

#include "chat.h"
#include "common.h"
#include "json.h"
#include "reasoning-budget.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <random>
#include <string>
#include <vector>

struct lmws_chat_templates {
    common_chat_templates_ptr tmpls;
};

// a parse's state across a stream: the text so far, the last message, the tool call ids given
struct lmws_chat_parser {
    common_chat_parser_params params;
    std::string               text;
    common_chat_msg           msg;
    std::vector<std::string>  ids;
};

namespace {

int fail(int status, const std::string & msg) {
    return lmws_fail_message(status, msg.c_str());
}

int out_string(const std::string & s, char ** out) {
    char * p = static_cast<char *>(std::malloc(s.size() + 1));
    if (p == nullptr) {
        return fail(LMWS_ENOMEM, "out of memory for the chat layer's answer");
    }
    std::memcpy(p, s.data(), s.size());
    p[s.size()] = '\0';
    *out = p;
    return LMWS_OK;
}

// every extern "C" body runs in here: a C++ exception becomes LMWS_ECHAT and its message
template <typename F>
int guarded(const char * what, F && body) {
    try {
        return body();
    } catch (const std::exception & e) {
        return fail(LMWS_ECHAT, std::string(what) + ": " + e.what());
    } catch (...) {
        return fail(LMWS_ECHAT, std::string(what) + ": an unknown C++ exception");
    }
}

// the ids llama-server gives tool calls that carry none (32 letters and digits)
std::string random_tool_call_id() {
    static const char alphabet[] = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    thread_local std::mt19937 gen(std::random_device{}());
    std::string id(32, ' ');
    for (auto & c : id) {
        c = alphabet[gen() % (sizeof(alphabet) - 1)];
    }
    return id;
}

common_json tool_call_json(const common_chat_tool_call & tc) {
    common_json j = common_json::object();
    j["id"]        = tc.id;
    j["name"]      = tc.name;
    j["arguments"] = tc.arguments;
    return j;
}

common_json msg_json(const common_chat_msg & msg) {
    common_json j = common_json::object();
    j["role"]              = msg.role;
    j["content"]           = msg.content;
    j["reasoning_content"] = msg.reasoning_content;
    common_json calls = common_json::array();
    for (const auto & tc : msg.tool_calls) {
        calls.push_back(tool_call_json(tc));
    }
    j["tool_calls"] = calls;
    return j;
}

common_json diff_json(const common_chat_msg_diff & d) {
    common_json j = common_json::object();
    j["reasoning_content_delta"] = d.reasoning_content_delta;
    j["content_delta"]           = d.content_delta;
    j["tool_call_index"]         = d.tool_call_index == std::string::npos ? (int64_t) -1 : (int64_t) d.tool_call_index;
    j["tool_call_delta"]         = tool_call_json(d.tool_call_delta);
    return j;
}

std::string str_or(const common_json & j, const char * key, const std::string & def) {
    return j.contains(key) && j.at(key).is_string() ? j.at(key).get<std::string>() : def;
}

bool bool_or(const common_json & j, const char * key, bool def) {
    return j.contains(key) && j.at(key).is_boolean() ? j.at(key).get<bool>() : def;
}

// feed a sampler the generation prompt's tokens, as llama-server primes its grammar and budget
// samplers with the prompt the template ended with; some tokenizers put a space before a first
// special token, which is not the prompt's. The sampler is freed if accepting throws.
void accept_generation_prompt(llama_sampler * smpl, const llama_vocab * vocab, const std::string & gp) {
    const auto ids = common_tokenize(vocab, gp, false, true);
    try {
        for (size_t i = 0; i < ids.size(); i++) {
            const std::string piece = common_token_to_piece(vocab, ids[i], true);
            if (i == 0 && !piece.empty() && std::isspace((unsigned char) piece[0]) &&
                !std::isspace((unsigned char) gp[0])) {
                continue;
            }
            llama_sampler_accept(smpl, ids[i]);
        }
    } catch (...) {
        llama_sampler_free(smpl);
        throw;
    }
}

}  // namespace

extern "C" {

int lmws_chat_templates_init(const struct llama_model * model, const char * override_src,
                             struct lmws_chat_templates ** out) {
    if (out == nullptr) {
        return fail(LMWS_EINVAL, "lmws_chat_templates_init: out is NULL");
    }
    *out = nullptr;
    const std::string src = override_src != nullptr ? override_src : "";
    if (model == nullptr && src.empty()) {  // common_chat_templates_init asserts a model then
        return fail(LMWS_EINVAL, "lmws_chat_templates_init: neither a model nor a template");
    }
    return guarded("the chat template", [&]() {
        auto * t  = new lmws_chat_templates();
        t->tmpls  = common_chat_templates_init(model, src);
        *out      = t;
        return LMWS_OK;
    });
}

void lmws_chat_templates_free(struct lmws_chat_templates * t) {
    delete t;
}

int lmws_chat_templates_info(const struct lmws_chat_templates * t, char ** out) {
    if (t == nullptr || out == nullptr) {
        return fail(LMWS_EINVAL, "lmws_chat_templates_info: NULL argument");
    }
    return guarded("the chat template", [&]() {
        common_json j = common_json::object();
        j["source"]                 = common_chat_templates_source(t->tmpls.get());
        j["tool_use_source"]        = common_chat_templates_source(t->tmpls.get(), "tool_use");
        j["was_explicit"]           = common_chat_templates_was_explicit(t->tmpls.get());
        j["supports_enable_thinking"] = common_chat_templates_support_enable_thinking(t->tmpls.get());
        common_json caps = common_json::object();
        for (const auto & [name, value] : common_chat_templates_get_caps(t->tmpls.get())) {
            caps[name] = value;
        }
        j["caps"] = caps;
        return out_string(j.dump(), out);
    });
}

// inputs: {"messages": [...], "tools": [...], "tool_choice": "auto"|"required"|"none",
// "json_schema": "<schema text>"|"", "grammar": "", "parallel_tool_calls": bool,
// "add_generation_prompt": bool, "continue_final_message": true|"content"|"reasoning_content"
// (absent: none; read by common_chat_continuation_parse), "reasoning_format": "<name>",
// "enable_thinking": bool, "chat_template_kwargs": {"<key>": "<JSON text>"}, "use_jinja": bool}
int lmws_chat_templates_apply(const struct lmws_chat_templates * t, const char * inputs_json, char ** out) {
    if (t == nullptr || inputs_json == nullptr || out == nullptr) {
        return fail(LMWS_EINVAL, "lmws_chat_templates_apply: NULL argument");
    }
    return guarded("the chat template", [&]() {
        const common_json in = common_json::parse(inputs_json);
        common_chat_templates_inputs inputs;
        inputs.messages = common_chat_msgs_parse_oaicompat(in.contains("messages") ? in.at("messages") : common_json::array());
        inputs.tools    = common_chat_tools_parse_oaicompat(in.contains("tools") ? in.at("tools") : common_json());
        inputs.tool_choice           = common_chat_tool_choice_parse_oaicompat(str_or(in, "tool_choice", "auto"));
        inputs.json_schema           = str_or(in, "json_schema", "");
        inputs.grammar               = str_or(in, "grammar", "");
        inputs.use_jinja             = bool_or(in, "use_jinja", true);
        inputs.parallel_tool_calls   = bool_or(in, "parallel_tool_calls", false);
        inputs.add_generation_prompt = bool_or(in, "add_generation_prompt", true);
        if (in.contains("continue_final_message")) {
            inputs.continue_final_message = common_chat_continuation_parse(in.at("continue_final_message"));
        }
        inputs.reasoning_format      = common_reasoning_format_from_name(str_or(in, "reasoning_format", "none"));
        inputs.enable_thinking       = bool_or(in, "enable_thinking", true);
        if (in.contains("chat_template_kwargs")) {
            for (const auto & [key, value] : in.at("chat_template_kwargs").items()) {
                inputs.chat_template_kwargs[key] = value.get<std::string>();
            }
        }
        const common_chat_params p = common_chat_templates_apply(t->tmpls.get(), inputs);

        common_json j = common_json::object();
        j["format"]            = (int64_t) p.format;
        j["format_name"]       = common_chat_format_name(p.format);
        j["prompt"]            = p.prompt;
        j["grammar"]           = p.grammar;
        j["grammar_lazy"]      = p.grammar_lazy;
        j["generation_prompt"] = p.generation_prompt;
        j["supports_thinking"] = p.supports_thinking;
        j["thinking_start_tag"] = p.thinking_start_tag;
        j["thinking_end_tags"] = p.thinking_end_tags;
        common_json triggers   = common_json::array();
        for (const auto & tr : p.grammar_triggers) {
            common_json tj = common_json::object();
            tj["type"]  = (int64_t) tr.type;
            tj["value"] = tr.value;
            tj["token"] = (int64_t) tr.token;
            triggers.push_back(tj);
        }
        j["grammar_triggers"]  = triggers;
        j["preserved_tokens"]  = p.preserved_tokens;
        j["additional_stops"]  = p.additional_stops;
        j["parser"]            = p.parser;
        return out_string(j.dump(), out);
    });
}

// params: {"format": int, "reasoning_format": "<name>", "reasoning_in_content": bool,
// "generation_prompt": "...", "parse_tool_calls": bool, "parser": "<the apply's parser>",
// "is_continuation": bool}; a continuation (a request's continue_final_message) starts from the
// parse of no text, as llama-server's task_result_state does, so that the first diff does not
// repeat the continued message's text (the generation prompt holds it)
int lmws_chat_parser_init(const char * params_json, struct lmws_chat_parser ** out) {
    if (params_json == nullptr || out == nullptr) {
        return fail(LMWS_EINVAL, "lmws_chat_parser_init: NULL argument");
    }
    *out = nullptr;
    return guarded("the chat parser", [&]() {
        const common_json in = common_json::parse(params_json);
        auto * ps = new lmws_chat_parser();
        try {
            const int64_t format = in.contains("format") ? in.at("format").get<int64_t>() : 0;
            if (format < 0 || format >= COMMON_CHAT_FORMAT_COUNT) {
                throw std::invalid_argument("unknown chat format " + std::to_string(format));
            }
            ps->params.format               = (common_chat_format) format;
            ps->params.reasoning_format     = common_reasoning_format_from_name(str_or(in, "reasoning_format", "none"));
            ps->params.reasoning_in_content = bool_or(in, "reasoning_in_content", false);
            ps->params.generation_prompt    = str_or(in, "generation_prompt", "");
            ps->params.parse_tool_calls     = bool_or(in, "parse_tool_calls", true);
            const std::string parser        = str_or(in, "parser", "");
            if (!parser.empty()) {
                ps->params.parser.load(parser);
            }
            ps->params.is_continuation = bool_or(in, "is_continuation", false);
            if (ps->params.is_continuation) {
                ps->msg = common_chat_parse("", true, ps->params);
            }
        } catch (...) {
            delete ps;
            throw;
        }
        *out = ps;
        return LMWS_OK;
    });
}

void lmws_chat_parser_free(struct lmws_chat_parser * ps) {
    delete ps;
}

// the text generated since the last call; out: {"message": {...}, "diffs": [...]}, the message
// as common_chat_parse reads all the text so far (with tool call ids kept across calls), the
// diffs as common_chat_msg_diff::compute_diffs finds them from the previous message
int lmws_chat_parser_update(struct lmws_chat_parser * ps, const char * text_added, bool is_partial, char ** out) {
    if (ps == nullptr || text_added == nullptr || out == nullptr) {
        return fail(LMWS_EINVAL, "lmws_chat_parser_update: NULL argument");
    }
    return guarded("the chat parser", [&]() {
        ps->text += text_added;
        common_chat_msg msg = common_chat_parse(ps->text, is_partial, ps->params);
        common_json diffs   = common_json::array();
        if (!msg.empty()) {
            msg.set_tool_call_ids(ps->ids, random_tool_call_id);
            for (const auto & d : common_chat_msg_diff::compute_diffs(ps->msg, msg)) {
                diffs.push_back(diff_json(d));
            }
            ps->msg = msg;
        }
        common_json j = common_json::object();
        j["message"] = msg_json(ps->msg);
        j["diffs"]   = diffs;
        return out_string(j.dump(), out);
    });
}

void lmws_chat_free_string(char * s) {
    std::free(s);
}

// the grammar sampler llama-server's common_sampler_init builds for a chat: lazy with its
// triggers (a word that is one preserved token triggers on that token, as the server turns
// it), or eager; an eager grammar of the chat layer's own (not the user's: prefill true) first
// accepts the generation prompt's tokens the template put at the end of the prompt
int lmws_chat_grammar_init(const struct llama_vocab * vocab, const char * grammar, bool lazy,
                           const char * triggers_json, const llama_token * preserved, size_t n_preserved,
                           const char * generation_prompt, bool prefill, struct llama_sampler ** out) {
    if (vocab == nullptr || grammar == nullptr || out == nullptr) {
        return fail(LMWS_EINVAL, "lmws_chat_grammar_init: NULL argument");
    }
    *out = nullptr;
    return guarded("the chat grammar", [&]() {
        std::vector<std::string> patterns;
        std::vector<llama_token> tokens;
        const std::vector<llama_token> kept(preserved, preserved + n_preserved);
        const common_json triggers = common_json::parse(triggers_json != nullptr ? triggers_json : "[]");
        for (size_t i = 0; i < triggers.size(); i++) {
            const common_json & tr = triggers.at(i);
            const auto type  = (common_grammar_trigger_type) tr.at("type").get<int64_t>();
            const auto value = tr.at("value").get<std::string>();
            switch (type) {
                case COMMON_GRAMMAR_TRIGGER_TYPE_WORD: {
                    const auto ids = common_tokenize(vocab, value, false, true);
                    if (ids.size() == 1) {
                        if (std::find(kept.begin(), kept.end(), ids[0]) == kept.end()) {
                            throw std::runtime_error("Grammar trigger word should be marked as preserved token: " + value);
                        }
                        tokens.push_back(ids[0]);
                    } else {
                        patterns.push_back(regex_escape(value));
                    }
                    break;
                }
                case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN:
                    patterns.push_back(value);
                    break;
                case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: {
                    std::string anchored = "^$";
                    if (!value.empty()) {
                        anchored = (value.front() != '^' ? "^" : "") + value + (value.back() != '$' ? "$" : "");
                    }
                    patterns.push_back(anchored);
                    break;
                }
                case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:
                    tokens.push_back((llama_token) tr.at("token").get<int64_t>());
                    break;
                default:
                    throw std::invalid_argument("unknown grammar trigger type " + std::to_string((int) type));
            }
        }
        if (lazy && patterns.empty() && tokens.empty()) {
            throw std::runtime_error("no triggers set for lazy grammar!");
        }
        std::vector<const char *> patterns_c;
        for (const auto & p : patterns) {
            patterns_c.push_back(p.c_str());
        }
        llama_sampler * smpl = lazy
            ? llama_sampler_init_grammar_lazy_patterns(vocab, grammar, "root", patterns_c.data(), patterns_c.size(),
                                                       tokens.data(), tokens.size())
            : llama_sampler_init_grammar(vocab, grammar, "root");
        if (smpl == nullptr) {
            throw std::runtime_error("failed to parse grammar");
        }
        if (!lazy && prefill && generation_prompt != nullptr && generation_prompt[0] != '\0') {
            accept_generation_prompt(smpl, vocab, generation_prompt);
        }
        *out = smpl;
        return LMWS_OK;
    });
}

// the reasoning budget sampler llama-server's common_sampler_init adds for a chat whose
// template has thinking tags (common_reasoning_budget_init): counting from the start tag, it
// forces `message` and the first end tag once `budget` tokens have gone by; it first accepts the
// generation prompt's tokens (a template that opens the thinking block starts it counting)
int lmws_reasoning_budget_init(const struct llama_vocab * vocab, const char * start_tag, const char * end_tags_json,
                               const char * message, int32_t budget, const char * generation_prompt,
                               struct llama_sampler ** out) {
    if (vocab == nullptr || start_tag == nullptr || end_tags_json == nullptr || out == nullptr) {
        return fail(LMWS_EINVAL, "lmws_reasoning_budget_init: NULL argument");
    }
    *out = nullptr;
    if (budget < 0) {
        return fail(LMWS_EINVAL, "lmws_reasoning_budget_init: the budget is -1 (unrestricted) or more");
    }
    return guarded("the reasoning budget", [&]() {
        const auto start = common_tokenize(vocab, start_tag, false, true);
        std::vector<llama_tokens> ends;
        const common_json tags = common_json::parse(end_tags_json);
        for (size_t i = 0; i < tags.size(); i++) {
            const auto tag = tags.at(i).get<std::string>();
            if (!tag.empty()) {
                ends.push_back(common_tokenize(vocab, tag, false, true));
            }
        }
        if (start.empty() || ends.empty()) {
            throw std::invalid_argument("a reasoning budget needs a start tag and an end tag");
        }
        llama_tokens forced = ends.front();
        if (message != nullptr && message[0] != '\0') {
            const auto msg = common_tokenize(vocab, message, false, true);
            forced.insert(forced.begin(), msg.begin(), msg.end());
        }
        llama_sampler * smpl = common_reasoning_budget_init(vocab, {start}, ends, forced, budget);
        if (smpl == nullptr) {
            throw std::runtime_error("the reasoning budget sampler could not be made");
        }
        accept_generation_prompt(smpl, vocab, generation_prompt != nullptr ? generation_prompt : "");
        *out = smpl;
        return LMWS_OK;
    });
}

}  // extern "C"
