/* The llama handles the shim takes; they come from the binding as plain addresses. */

struct llama_model;
struct llama_context;
struct llama_vocab;
struct llama_sampler;

typedef int32_t llama_token;

/* Phase-aware workspace (llama.h, patch 0005). */
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
