/* The llama handles the shim takes; they come from the binding as plain addresses. */

struct llama_model;
struct llama_context;
struct llama_vocab;
struct llama_sampler;
struct llama_model_params;
struct llama_context_params;
struct llama_model_tensor_buft_override;

typedef int32_t llama_token;

/* Phase-aware workspace (llama.h, patches 0005 and 0010). */
struct llama_workspace_info {
    bool     enabled;
    bool     paired;
    bool     owner;
    uint64_t generation;
    uint64_t shrink_epoch;
    uint32_t n_phase_tokens;
    int32_t  n_rebuilds;
    int32_t  n_handoff_syncs;
    ...;
};

struct llama_compute_buffer_state {
    bool     resizable;
    bool     shared;
    bool     alias;
    size_t   owner_need;
    size_t   borrower_need;
    size_t   allocated;
    uint64_t generation;
    int32_t  n_grow;
    int32_t  n_shrink;
    ...;
};

enum llama_workspace_meta_sharing {
    LLAMA_WORKSPACE_META_ALIAS,
    LLAMA_WORKSPACE_META_PRIVATE,
    LLAMA_WORKSPACE_META_UNSAFE,
    ...
};
