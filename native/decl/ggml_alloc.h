/* Resizable shared compute buffers (ggml-alloc.h, patch 0002). */

enum ggml_gallocr_role {
    GGML_GALLOCR_ROLE_NONE,
    GGML_GALLOCR_ROLE_OWNER,
    GGML_GALLOCR_ROLE_BORROWER,
    ...
};

struct ggml_gallocr_buffer_state {
    enum ggml_gallocr_role role;
    bool     shared;
    bool     alias;
    size_t   owner_need;
    size_t   borrower_need;
    size_t   allocated;
    uint64_t generation;
    int      n_grow;
    int      n_shrink;
    ...;
};

enum ggml_gallocr_meta_sharing {
    GGML_GALLOCR_META_ALIAS,
    GGML_GALLOCR_META_PRIVATE,
    GGML_GALLOCR_META_UNSAFE,
    ...
};

/* testing: from the n-th following non-empty buffer allocation on, the next `count` allocations
   of at least min_size bytes fail (count -1: until disarmed with n == 0) (patch 0004) */
void ggml_backend_inject_alloc_failure(int n, int count, size_t min_size);
