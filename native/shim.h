// llama-metaws shim: a thin C layer over the patched llama.cpp for cffi.
//
// Each lmws_* call checks its arguments, returns an LMWS_* status (0 or negative) and, on a
// failure, records a message that lmws_last_error() returns on the same thread. The Python side
// turns statuses into exceptions in one place (llama_metaws/errors.py).
#pragma once

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "llama.h"

#define LMWS_OK          0
#define LMWS_EINVAL     -1
#define LMWS_ERANGE     -2
#define LMWS_ENOMEM     -3
#define LMWS_ENOTSUP    -4
#define LMWS_EFAILED    -5
#define LMWS_EGRAMMAR   -6   // a grammar that does not parse, or that no token can continue
#define LMWS_ESAMPLER   -7   // llama.cpp's sampler threw (caught in sampler.cpp)
#define LMWS_ECHAT      -8   // llama.cpp's chat layer threw (caught in chat_layer.cpp)

// lmws_workspace_attach: the contexts cannot share (not an error: both stay private)
#define LMWS_NOT_ELIGIBLE 1

#ifdef __cplusplus
extern "C" {
#endif

const char * lmws_last_error(void);
// record msg for lmws_last_error and return status (for the shim's C++ side)
int lmws_fail_message(int status, const char * msg);

struct lmws_compute_buffer {
    ggml_backend_buffer_type_t buft;
    ggml_backend_dev_t         device;
    size_t                     size;
};

int lmws_n_compute_buffers(const struct llama_context * ctx, int * n);
int lmws_get_compute_buffer(const struct llama_context * ctx, int i, struct lmws_compute_buffer * out);

int lmws_workspace_enable(struct llama_context * ctx, bool enabled, uint32_t n_decode_tokens);
int lmws_workspace_attach(struct llama_context * borrower, struct llama_context * owner);
int lmws_workspace_detach(struct llama_context * ctx);
int lmws_workspace_info(const struct llama_context * ctx, struct llama_workspace_info * info);
int lmws_compute_buffer_state(const struct llama_context * ctx, int i, struct llama_compute_buffer_state * state);

// sharing: an enum llama_workspace_meta_sharing value
int lmws_workspace_set_meta_sharing(struct llama_context * owner, int sharing);
int lmws_cpu_meta_device(int n_devices, ggml_backend_dev_t * out);
// the ggml-level reproduction: sharing is an enum ggml_gallocr_meta_sharing value
int lmws_repro_meta_shared(int sharing, int n_devices, uint64_t * owner_generations);
int lmws_meta_alias_check(int n_devices, int * alias_of_plain, int * alias_of_alias);

// testing: from the n-th following non-empty buffer allocation on, the next `count` of at least
// min_size bytes fail (count -1: until n == 0 disarms); LMWS_ENOTSUP when the build has no
// injector (ggml built without GGML_ALLOC_FAULT_INJECTION, patch 0004)
int lmws_inject_alloc_failure(int n, int count, size_t min_size);

// prompt reuse: the recurrent state of a sequence as it stood n_back positions before its last
// one, from its last decode's rollback snapshots (patch 0024); *size 0: they do not reach back
int lmws_state_seq_size_back(struct llama_context * ctx, int32_t seq_id, uint32_t n_back, size_t * size);
int lmws_state_seq_get_back(struct llama_context * ctx, int32_t seq_id, uint32_t n_back,
                            uint8_t * dst, size_t size, size_t * written);

// the planner: llama.cpp's memory breakdown of a context, one entry per buffer type
// (breakdown.cpp). With a no_alloc model these are the bytes the allocators would allocate;
// compute counts each scheduler backend, so a buffer type used by k backends is counted k times.
struct lmws_memory_entry {
    ggml_backend_buffer_type_t buft;
    size_t                     model;    // weights
    size_t                     context;  // KV cache and recurrent state
    size_t                     compute;  // compute buffers
};
int lmws_memory_breakdown(const struct llama_context * ctx, struct lmws_memory_entry * out, int capacity, int * n);

// draft-mtp with several NextN heads (nextn.cpp): the head an MTP context's next decodes run,
// llama_set_nextn_layer_offset with the offset checked against the model's NextN blocks
// (LMWS_ERANGE: none there; llama.cpp would abort building the graph)
int lmws_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset);

// llama.cpp's fitting of unset parameters to free device memory (fit.cpp: common/fit.h's
// common_fit_params, llama-server's --fit): n_gpu_layers -1 and n_ctx 0 are fitted in place,
// tensor_split (llama_max_devices() floats) and overrides (llama_max_tensor_buft_overrides()
// entries) are written when the fit spreads the model; margins: bytes to leave free per device;
// draft_cparams: an MTP draft context's params, fitted alongside (NULL: none); draft_path: its model's
// own file (-md), loaded with mparams and its NextN blocks (NULL: the target's weights). *status: an enum
// common_params_fit_status (0 fitted, 1 could not fit, 2 an error); the params are usable either way
int lmws_fit_params(const char * path_model, struct llama_model_params * mparams,
                    struct llama_context_params * cparams, float * tensor_split,
                    struct llama_model_tensor_buft_override * overrides, size_t * margins,
                    uint32_t n_ctx_min, const struct llama_context_params * draft_cparams,
                    const char * draft_path, bool verbose, int * status);

// ggml's RPC backend (rpc.c), through the registry's proc addresses
int lmws_rpc_add_server(const char * endpoint, ggml_backend_dev_t * out, int capacity, int * n);
int lmws_rpc_register_device(ggml_backend_dev_t dev);
int lmws_rpc_server_ok(const char * endpoint, bool * ok);
int lmws_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads,
                          ggml_backend_dev_t * devices, size_t n_devices);

// grammars and sampling that never let a C++ exception out (sampler.cpp): a grammar's parse
// error as the message; llama_sampler_sample's steps with a check that some token is left
// before accepting; accept that asks the chain's grammars first
int lmws_grammar_check(const struct llama_vocab * vocab, const char * grammar, const char * root);
int lmws_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx, llama_token * out);
int lmws_sampler_accept(struct llama_sampler * smpl, llama_token token);
// the same sampling without the accept (the caller accepts the token it takes), and the accept
// of a synthetic draft token: every sampler of the chain but its grammars and reasoning budget
int lmws_sampler_select(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx, llama_token * out);
int lmws_sampler_accept_draft(struct llama_sampler * smpl, llama_token token);

// llama.cpp's chat layer, common/chat.h (chat_layer.cpp): JSON in, JSON out (malloc'ed strings,
// freed with lmws_chat_free_string); what it throws is LMWS_ECHAT with the exception's text.
// override_src: a template's text (or llama.cpp's "chatml"); NULL or "": the model's own
struct lmws_chat_templates;
struct lmws_chat_parser;
int  lmws_chat_templates_init(const struct llama_model * model, const char * override_src,
                              struct lmws_chat_templates ** out);
void lmws_chat_templates_free(struct lmws_chat_templates * t);
int  lmws_chat_templates_info(const struct lmws_chat_templates * t, char ** out);
int  lmws_chat_templates_apply(const struct lmws_chat_templates * t, const char * inputs_json, char ** out);
int  lmws_chat_parser_init(const char * params_json, struct lmws_chat_parser ** out);
void lmws_chat_parser_free(struct lmws_chat_parser * ps);
int  lmws_chat_parser_update(struct lmws_chat_parser * ps, const char * text_added, bool is_partial, char ** out);
void lmws_chat_free_string(char * s);
int  lmws_chat_grammar_init(const struct llama_vocab * vocab, const char * grammar, bool lazy,
                            const char * triggers_json, const llama_token * preserved, size_t n_preserved,
                            const char * generation_prompt, bool prefill, struct llama_sampler ** out);
int  lmws_reasoning_budget_init(const struct llama_vocab * vocab, const char * start_tag, const char * end_tags_json,
                                const char * message, int32_t budget, const char * generation_prompt,
                                struct llama_sampler ** out);

#ifdef __cplusplus
}
#endif
