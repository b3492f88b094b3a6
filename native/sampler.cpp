// llama-metaws shim, C++ side: grammar checks and sampling that never let a C++ exception out.
//
// llama.cpp's sampling throws where a request asks for something the model cannot give: a
// grammar sampler accepting a token none of its stacks can take throws std::runtime_error
// ("Unexpected empty grammar stack after accepting piece"), and through the C API (ctypes) that
// is std::terminate for the whole process. It happens whenever the grammar rules out every
// token of the vocabulary: llama_grammar_apply_impl sets every candidate's logit to -inf, the
// selecting sampler (greedy, dist) still selects one, and llama_sampler_sample accepts it
// unchecked. These calls do the same steps with the checks in between, and catch what is thrown.
// They sample on the CPU from the context's logits row: a context whose backend samplers already
// chose a token (llama_get_sampled_token_ith) is not what they handle; the binding sets none.
//
// A grammar that does not parse makes llama_sampler_init_grammar return NULL (the binding adds
// that NULL to its chain: a segfault later) and prints the reason on stderr or through llama's
// log; lmws_grammar_check returns it as the error message instead.
#include "shim.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

namespace {

int fail(int status, const std::string & msg) {
    return lmws_fail_message(status, msg.c_str());
}

// ---- what llama.cpp says while it parses a grammar ------------------------------------------
//
// The parser's exception text goes to C's stderr (llama_grammar_parser::parse), the other
// refusals (no root symbol, left recursion) through llama's log. Both are process-wide, so one
// check captures them at a time (g_check_mutex); the log callback in place is called too, so
// nothing is lost. What the capture touches is static, not on a check's stack: another thread
// that read the callback, or the stream, during a check may still use it just after.

std::mutex g_check_mutex;

struct log_capture {
    std::mutex        mutex;  // a late call from another thread may come while the next check reads
    ggml_log_callback previous      = nullptr;
    void *            previous_data = nullptr;
    std::string       errors;
};

log_capture g_log;

void capture_log(enum ggml_log_level level, const char * text, void * user_data) {
    auto * cap = static_cast<log_capture *>(user_data);
    ggml_log_callback previous;
    void *            previous_data;
    {
        std::lock_guard<std::mutex> lock(cap->mutex);
        if (level == GGML_LOG_LEVEL_ERROR && text != nullptr) {
            cap->errors += text;
        }
        previous      = cap->previous;
        previous_data = cap->previous_data;
    }
    if (previous != nullptr) {
        previous(level, text, previous_data);
    }
}

#if defined(__GLIBC__)
// glibc's stderr is an assignable FILE *; the capture stream is opened once and never closed,
// and read under its own lock, so a thread that took the pointer during a check and writes late
// neither writes into a freed stream nor moves its buffer while it is read
FILE * g_stderr_capture      = nullptr;
char * g_stderr_capture_buf  = nullptr;
size_t g_stderr_capture_size = 0;
#endif

std::string trim(std::string s) {
    const char * ws = " \t\r\n";
    s.erase(0, s.find_first_not_of(ws));
    const size_t end = s.find_last_not_of(ws);
    s.erase(end == std::string::npos ? 0 : end + 1);
    return s;
}

// the parser prints "parse: error parsing grammar: <what>\n\n<the grammar>\n": keep <what>
std::string parse_message(const std::string & printed) {
    static const std::string marker = "error parsing grammar: ";
    const size_t at = printed.find(marker);
    if (at == std::string::npos) {
        return "";
    }
    const size_t start = at + marker.size();
    const size_t end   = printed.find("\n\n", start);
    return trim(printed.substr(start, end == std::string::npos ? std::string::npos : end - start));
}

// a sampler's name; llama_sampler_name calls iface->name unchecked, and the binding's Python
// samplers (logits processors) leave it NULL
const char * name_of(const struct llama_sampler * smpl) {
    if (smpl == nullptr || smpl->iface == nullptr || smpl->iface->name == nullptr) {
        return nullptr;
    }
    return smpl->iface->name(smpl);
}

bool is_grammar(const struct llama_sampler * smpl) {
    const char * name = name_of(smpl);
    return name != nullptr && std::strcmp(name, "grammar") == 0;
}

bool is_reasoning_budget(const struct llama_sampler * smpl) {
    const char * name = name_of(smpl);
    return name != nullptr && std::strcmp(name, "reasoning-budget") == 0;
}

bool is_chain(const struct llama_sampler * smpl) {
    const char * name = name_of(smpl);
    return name != nullptr && std::strcmp(name, "chain") == 0;
}

// whether every grammar sampler of `smpl` (a chain or one sampler) allows `token` next: the
// grammar's apply on that one candidate, which reads the grammar's state and changes nothing
bool grammar_allows(struct llama_sampler * smpl, llama_token token) {
    if (is_chain(smpl)) {
        const int n = llama_sampler_chain_n(smpl);
        for (int i = 0; i < n; i++) {
            if (!grammar_allows(llama_sampler_chain_get(smpl, i), token)) {
                return false;
            }
        }
        return true;
    }
    if (!is_grammar(smpl)) {
        return true;
    }
    llama_token_data       data = { token, 0.0f, 0.0f };
    llama_token_data_array one  = { &data, 1, -1, false };
    llama_sampler_apply(smpl, &one);
    return data.logit != -INFINITY;
}

std::string threw(const char * what) {
    return std::string("llama.cpp's sampler threw: ") + (what ? what : "an unknown exception");
}

} // namespace

extern "C" int lmws_grammar_check(const struct llama_vocab * vocab, const char * grammar, const char * root) {
    if (grammar == nullptr || root == nullptr) {
        return fail(LMWS_EINVAL, "grammar check: NULL grammar or root");
    }
    if (grammar[0] == '\0') {
        return fail(LMWS_EGRAMMAR, "the grammar is empty");
    }
    std::lock_guard<std::mutex> check(g_check_mutex);

    {
        std::lock_guard<std::mutex> lock(g_log.mutex);
        g_log.errors.clear();
        llama_log_get(&g_log.previous, &g_log.previous_data);
    }
    llama_log_set(capture_log, &g_log);
#if defined(__GLIBC__)
    if (g_stderr_capture == nullptr) {
        g_stderr_capture = open_memstream(&g_stderr_capture_buf, &g_stderr_capture_size);
    }
    FILE * real_stderr = stderr;
    if (g_stderr_capture != nullptr) {
        fseek(g_stderr_capture, 0, SEEK_SET);
        stderr = g_stderr_capture;
    }
#endif
    struct llama_sampler * smpl = nullptr;
    std::string thrown;
    try {
        smpl = llama_sampler_init_grammar(vocab, grammar, root);
    } catch (const std::exception & e) {
        thrown = e.what();
    } catch (...) {
        thrown = "an unknown exception";
    }
    std::string printed;
#if defined(__GLIBC__)
    if (g_stderr_capture != nullptr) {
        stderr = real_stderr;
        flockfile(g_stderr_capture);
        fflush(g_stderr_capture);
        printed.assign(g_stderr_capture_buf, g_stderr_capture_size);
        funlockfile(g_stderr_capture);
    }
#endif
    llama_log_set(g_log.previous, g_log.previous_data);
    std::string logged;
    {
        std::lock_guard<std::mutex> lock(g_log.mutex);
        logged.swap(g_log.errors);
    }

    if (smpl != nullptr) {
        llama_sampler_free(smpl);
        return LMWS_OK;
    }
    std::string why = !thrown.empty() ? thrown : parse_message(printed);
    if (why.empty()) {
        why = trim(logged);
    }
    if (why.empty()) {
        why = "llama.cpp refused it (see its log)";
    }
    return fail(LMWS_EGRAMMAR, "the grammar is not valid: " + why);
}

namespace {

// llama_sampler_sample's steps on output idx of ctx; the chosen token accepted when `accept`
int sample_row(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx, bool accept,
               llama_token * out) {
    if (smpl == nullptr || ctx == nullptr || out == nullptr) {
        return fail(LMWS_EINVAL, "sample: NULL sampler or context");
    }
    try {
        const float * logits = llama_get_logits_ith(ctx, idx);
        if (logits == nullptr) {
            return fail(LMWS_ERANGE, "sample: the context has no logits at output " + std::to_string(idx));
        }
        const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        thread_local std::vector<llama_token_data> cur;
        cur.resize(n_vocab);
        for (llama_token id = 0; id < n_vocab; id++) {
            cur[id] = llama_token_data{ id, logits[id], 0.0f };
        }
        llama_token_data_array cur_p = { cur.data(), cur.size(), -1, false };
        llama_sampler_apply(smpl, &cur_p);
        if (cur_p.selected < 0 || cur_p.selected >= (int64_t) cur_p.size) {
            return fail(LMWS_ESAMPLER, "sample: the sampler chain selected no token");
        }
        const llama_token_data & chosen = cur_p.data[cur_p.selected];
        if (std::isnan(chosen.logit)) {
            return fail(LMWS_ESAMPLER, "sample: the model's logits are NaN");
        }
        if (chosen.logit == -INFINITY) {
            // every candidate was ruled out; accepting one would throw (or abort) in the grammar
            return fail(LMWS_EGRAMMAR, "no token can be sampled: every token of the vocabulary is "
                        "ruled out here (the grammar allows none of them, or a logit bias or "
                        "min_tokens removed the ones it allows)");
        }
        if (accept) {
            llama_sampler_accept(smpl, chosen.id);
        }
        *out = chosen.id;
        return LMWS_OK;
    } catch (const std::exception & e) {
        return fail(LMWS_ESAMPLER, threw(e.what()));
    } catch (...) {
        return fail(LMWS_ESAMPLER, threw(nullptr));
    }
}

} // namespace

extern "C" int lmws_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx,
                                   llama_token * out) {
    return sample_row(smpl, ctx, idx, true, out);
}

extern "C" int lmws_sampler_select(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx,
                                   llama_token * out) {
    return sample_row(smpl, ctx, idx, false, out);
}

extern "C" int lmws_sampler_accept(struct llama_sampler * smpl, llama_token token) {
    if (smpl == nullptr) {
        return fail(LMWS_EINVAL, "accept: NULL sampler");
    }
    try {
        // a grammar that cannot take the token throws in accept (an end-of-generation token
        // before the grammar is complete aborts): ask it first
        if (!grammar_allows(smpl, token)) {
            return fail(LMWS_EGRAMMAR, "token " + std::to_string(token) + " is not allowed by the grammar here");
        }
        llama_sampler_accept(smpl, token);
        return LMWS_OK;
    } catch (const std::exception & e) {
        return fail(LMWS_ESAMPLER, threw(e.what()));
    } catch (...) {
        return fail(LMWS_ESAMPLER, threw(nullptr));
    }
}

extern "C" int lmws_sampler_accept_draft(struct llama_sampler * smpl, llama_token token) {
    if (smpl == nullptr) {
        return fail(LMWS_EINVAL, "accept: NULL sampler");
    }
    try {
        // what llama-server's common_sampler_accept(..., is_generated = false) does for a
        // synthetic draft token: the chain's samplers take it, its grammars and reasoning
        // budget do not (they see only what the target samples)
        if (!is_chain(smpl)) {
            if (!is_grammar(smpl) && !is_reasoning_budget(smpl)) {
                llama_sampler_accept(smpl, token);
            }
            return LMWS_OK;
        }
        const int n = llama_sampler_chain_n(smpl);
        for (int i = 0; i < n; i++) {
            struct llama_sampler * s = llama_sampler_chain_get(smpl, i);
            if (!is_grammar(s) && !is_reasoning_budget(s)) {
                llama_sampler_accept(s, token);
            }
        }
        return LMWS_OK;
    } catch (const std::exception & e) {
        return fail(LMWS_ESAMPLER, threw(e.what()));
    } catch (...) {
        return fail(LMWS_ESAMPLER, threw(nullptr));
    }
}
