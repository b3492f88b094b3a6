/* The shim's own calls (native/shim.h; values and layout come from there). Every lmws_* call returns an LMWS_* status;
   llama_metaws.errors.check_error turns a negative one into a Python exception carrying
   lmws_last_error(). */

#define LMWS_OK ...
#define LMWS_EINVAL ...
#define LMWS_ERANGE ...
#define LMWS_ENOMEM ...
#define LMWS_ENOTSUP ...
#define LMWS_EFAILED ...
#define LMWS_EGRAMMAR ...
#define LMWS_ESAMPLER ...
#define LMWS_NOT_ELIGIBLE ...

const char * lmws_last_error(void);

struct lmws_compute_buffer {
    ggml_backend_buffer_type_t buft;
    ggml_backend_dev_t         device;   /* the backend's device */
    size_t                     size;     /* bytes allocated now */
    ...;
};

int lmws_n_compute_buffers(const struct llama_context * ctx, int * n);
int lmws_get_compute_buffer(const struct llama_context * ctx, int i, struct lmws_compute_buffer * out);

int lmws_workspace_enable(struct llama_context * ctx, bool enabled, uint32_t n_decode_tokens);
int lmws_workspace_attach(struct llama_context * borrower, struct llama_context * owner);
int lmws_workspace_detach(struct llama_context * ctx);
int lmws_workspace_info(const struct llama_context * ctx, struct llama_workspace_info * info);
int lmws_compute_buffer_state(const struct llama_context * ctx, int i, struct ggml_gallocr_buffer_state * state);

int lmws_workspace_set_meta_sharing(struct llama_context * owner, int sharing);
int lmws_cpu_meta_device(int n_devices, ggml_backend_dev_t * out);
int lmws_repro_meta_shared(int sharing, int n_devices, uint64_t * owner_generations);
int lmws_meta_alias_check(int n_devices, int * alias_of_plain, int * alias_of_alias);

/* prompt reuse: a recurrent state n_back positions back, from the rollback snapshots (patch 0018);
   *size 0 when they do not reach back so far */
int lmws_state_seq_size_back(struct llama_context * ctx, int32_t seq_id, uint32_t n_back, size_t * size);
int lmws_state_seq_get_back(struct llama_context * ctx, int32_t seq_id, uint32_t n_back,
                            uint8_t * dst, size_t size, size_t * written);

/* the planner (breakdown.cpp): llama.cpp's memory breakdown, one entry per buffer type */
struct lmws_memory_entry {
    ggml_backend_buffer_type_t buft;
    size_t                     model;
    size_t                     context;
    size_t                     compute;
    ...;
};
int lmws_memory_breakdown(const struct llama_context * ctx, struct lmws_memory_entry * out, int capacity, int * n);

/* ggml's RPC backend (rpc.c): its servers' devices, whether a server is still there (patch 0014),
   and ggml's RPC server, which serves until the process ends */
int lmws_rpc_add_server(const char * endpoint, ggml_backend_dev_t * out, int capacity, int * n);
int lmws_rpc_register_device(ggml_backend_dev_t dev);
int lmws_rpc_server_ok(const char * endpoint, bool * ok);
int lmws_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads,
                          ggml_backend_dev_t * devices, size_t n_devices);

/* grammars and sampling (sampler.cpp): no C++ exception leaves these; LMWS_EGRAMMAR for a grammar
   that does not parse (llama.cpp's parse message) or that no token can continue, LMWS_ESAMPLER
   for anything llama.cpp's samplers threw */
int lmws_grammar_check(const struct llama_vocab * vocab, const char * grammar, const char * root);
int lmws_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx, llama_token * out);
int lmws_sampler_accept(struct llama_sampler * smpl, llama_token token);
