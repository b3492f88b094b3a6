// llama-metaws shim: see shim.h.
#include "shim.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char lmws_error_msg[512];

const char * lmws_last_error(void) {
    return lmws_error_msg;
}

int lmws_fail_message(int status, const char * msg) {
    snprintf(lmws_error_msg, sizeof(lmws_error_msg), "%s", msg);
    return status;
}

static int lmws_fail(int status, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(lmws_error_msg, sizeof(lmws_error_msg), fmt, args);
    va_end(args);
    return status;
}

int lmws_n_compute_buffers(const struct llama_context * ctx, int * n) {
    if (ctx == NULL || n == NULL) {
        return lmws_fail(LMWS_EINVAL, "lmws_n_compute_buffers: NULL context");
    }
    *n = llama_n_compute_buffers(ctx);
    return LMWS_OK;
}

int lmws_get_compute_buffer(const struct llama_context * ctx, int i, struct lmws_compute_buffer * out) {
    if (ctx == NULL || out == NULL) {
        return lmws_fail(LMWS_EINVAL, "lmws_get_compute_buffer: NULL context");
    }
    ggml_backend_dev_t         dev  = NULL;
    ggml_backend_buffer_type_t buft = NULL;
    size_t                     size = 0;
    if (!llama_get_compute_buffer(ctx, i, &dev, &buft, &size)) {
        return lmws_fail(LMWS_ERANGE, "compute buffer %d out of range (the context has %d)",
                         i, llama_n_compute_buffers(ctx));
    }
    out->buft   = buft;
    out->device = dev;
    out->size   = size;
    return LMWS_OK;
}

// phase-aware workspace

int lmws_workspace_enable(struct llama_context * ctx, bool enabled, uint32_t n_decode_tokens) {
    if (ctx == NULL) {
        return lmws_fail(LMWS_EINVAL, "workspace: NULL context");
    }
    llama_set_phase_aware_workspace(ctx, enabled, n_decode_tokens);
    return LMWS_OK;
}

int lmws_workspace_attach(struct llama_context * borrower, struct llama_context * owner) {
    if (borrower == NULL || owner == NULL) {
        return lmws_fail(LMWS_EINVAL, "workspace: NULL %s context", borrower == NULL ? "draft" : "target");
    }
    if (borrower == owner) {
        return lmws_fail(LMWS_EINVAL, "workspace: the draft and the target are the same context");
    }
    switch (llama_attach_shared_workspace(borrower, owner)) {
        case 1:
            return LMWS_OK;
        case 0:
            return LMWS_NOT_ELIGIBLE; // llama logged why
        default:
            return lmws_fail(LMWS_ENOMEM, "workspace: the shared compute buffers could not be allocated; "
                                          "both contexts keep private buffers");
    }
}

int lmws_workspace_detach(struct llama_context * ctx) {
    if (ctx == NULL) {
        return lmws_fail(LMWS_EINVAL, "workspace: NULL context");
    }
    llama_detach_shared_workspace(ctx);
    return LMWS_OK;
}

int lmws_workspace_info(const struct llama_context * ctx, struct llama_workspace_info * info) {
    if (ctx == NULL || info == NULL) {
        return lmws_fail(LMWS_EINVAL, "workspace: NULL context");
    }
    llama_get_workspace_info(ctx, info);
    return LMWS_OK;
}

int lmws_compute_buffer_state(const struct llama_context * ctx, int i, struct llama_compute_buffer_state * state) {
    if (ctx == NULL || state == NULL) {
        return lmws_fail(LMWS_EINVAL, "workspace: NULL context");
    }
    if (!llama_get_compute_buffer_state(ctx, i, state)) {
        return lmws_fail(LMWS_ERANGE, "compute buffer %d out of range (the context has %d)",
                         i, llama_n_compute_buffers(ctx));
    }
    return LMWS_OK;
}

// prompt reuse: a checkpoint from the rollback snapshots

int lmws_state_seq_size_back(struct llama_context * ctx, int32_t seq_id, uint32_t n_back, size_t * size) {
    if (ctx == NULL || size == NULL) {
        return lmws_fail(LMWS_EINVAL, "state: NULL context");
    }
    *size = llama_state_seq_get_size_back(ctx, seq_id, n_back);
    return LMWS_OK;
}

int lmws_state_seq_get_back(struct llama_context * ctx, int32_t seq_id, uint32_t n_back,
                            uint8_t * dst, size_t size, size_t * written) {
    if (ctx == NULL || dst == NULL || written == NULL) {
        return lmws_fail(LMWS_EINVAL, "state: NULL context or buffer");
    }
    *written = llama_state_seq_get_data_back(ctx, dst, size, seq_id, n_back);
    if (*written == 0) {
        return lmws_fail(LMWS_EFAILED, "state: sequence %d as it stood %u positions back could not be "
                                       "written into %zu bytes (see llama's log)", (int) seq_id, n_back, size);
    }
    return LMWS_OK;
}

// tensor split: meta sharing, and the ggml-level reproduction of the shared meta buffer crash

int lmws_workspace_set_meta_sharing(struct llama_context * owner, int sharing) {
    if (owner == NULL) {
        return lmws_fail(LMWS_EINVAL, "workspace: NULL target context");
    }
    if (sharing < LLAMA_WORKSPACE_META_ALIAS || sharing > LLAMA_WORKSPACE_META_UNSAFE) {
        return lmws_fail(LMWS_EINVAL, "workspace: unknown meta sharing %d", sharing);
    }
    llama_set_workspace_meta_sharing(owner, (enum llama_workspace_meta_sharing) sharing);
    return LMWS_OK;
}

// a testing hook that only builds with GGML_ALLOC_FAULT_INJECTION have: a weak reference, NULL
// where the library does not define it (declared in ggml's internal ggml-backend-impl.h)
extern void ggml_backend_inject_alloc_failure(int n, int count, size_t min_size) __attribute__((weak));

int lmws_inject_alloc_failure(int n, int count, size_t min_size) {
    if (ggml_backend_inject_alloc_failure == NULL) {
        return lmws_fail(LMWS_ENOTSUP, "allocation failures cannot be injected: ggml was built without "
                                       "GGML_ALLOC_FAULT_INJECTION (llama-metaws builds turn it on unless "
                                       "CMAKE_ARGS turns it off)");
    }
    ggml_backend_inject_alloc_failure(n, count, min_size);
    return LMWS_OK;
}

// every tensor the same on all devices: the test bed needs no real split, only the meta machinery
static struct ggml_backend_meta_split_state lmws_mirrored(const struct ggml_tensor * tensor, void * ud) {
    (void) tensor;
    (void) ud;
    struct ggml_backend_meta_split_state st = { GGML_BACKEND_SPLIT_AXIS_MIRRORED, { 0 }, { 1 }, 1 };
    return st;
}

int lmws_cpu_meta_device(int n_devices, ggml_backend_dev_t * out) {
    if (n_devices < 1 || n_devices > 4 || out == NULL) {
        return lmws_fail(LMWS_EINVAL, "meta device: 1 to 4 CPU devices, not %d", n_devices);
    }
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu == NULL) {
        return lmws_fail(LMWS_ENOTSUP, "meta device: no CPU device");
    }
    ggml_backend_dev_t devs[4] = { cpu, cpu, cpu, cpu };
    *out = ggml_backend_meta_device(devs, (size_t) n_devices, lmws_mirrored, NULL);
    return *out ? LMWS_OK : lmws_fail(LMWS_EFAILED, "meta device: ggml_backend_meta_device failed");
}

// one graph: y = scale * x over n floats, in its own ggml context
struct lmws_scale_graph {
    struct ggml_context * ctx;
    struct ggml_cgraph  * graph;
    struct ggml_tensor  * x;
    struct ggml_tensor  * y;
};

static void lmws_scale_graph_init(struct lmws_scale_graph * g, int n, float scale) {
    struct ggml_init_params params = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    g->ctx = ggml_init(params);
    g->x   = ggml_new_tensor_1d(g->ctx, GGML_TYPE_F32, n);
    ggml_set_input(g->x);
    g->y   = ggml_scale(g->ctx, g->x, scale);
    ggml_set_output(g->y);
    g->graph = ggml_new_graph(g->ctx);
    ggml_build_forward_expand(g->graph, g->y);
}

// set x to base + i, compute, check y == scale * x
static int lmws_scale_graph_run(struct lmws_scale_graph * g, ggml_backend_t backend, float base, float scale, const char * who) {
    float buf[256];
    const int n = (int) ggml_nelements(g->x);
    for (int i = 0; i < n; i++) {
        buf[i] = base + (float) i;
    }
    ggml_backend_tensor_set(g->x, buf, 0, n * sizeof(float)); // the owner's reused graph aborts here when unsafe
    if (ggml_backend_graph_compute(backend, g->graph) != GGML_STATUS_SUCCESS) {
        return lmws_fail(LMWS_EFAILED, "repro: the %s graph failed to compute", who);
    }
    ggml_backend_tensor_get(g->y, buf, 0, n * sizeof(float));
    for (int i = 0; i < n; i++) {
        if (buf[i] != scale * (base + (float) i)) {
            return lmws_fail(LMWS_EFAILED, "repro: the %s graph computed %g at %d, expected %g",
                             who, buf[i], i, scale * (base + (float) i));
        }
    }
    return LMWS_OK;
}

int lmws_repro_meta_shared(int sharing, int n_devices, uint64_t * owner_generations) {
    ggml_backend_dev_t meta = NULL;
    int status = lmws_cpu_meta_device(n_devices, &meta);
    if (status != LMWS_OK) {
        return status;
    }
    ggml_backend_t             backend = ggml_backend_dev_init(meta, NULL);
    ggml_backend_buffer_type_t buft    = ggml_backend_get_default_buffer_type(backend);
    ggml_gallocr_t             owner    = ggml_gallocr_new(buft);
    ggml_gallocr_t             borrower = ggml_gallocr_new(buft);
    struct lmws_scale_graph    go, gb;
    lmws_scale_graph_init(&go, 64, 2.0f);
    lmws_scale_graph_init(&gb, 32, 3.0f); // smaller: fits in the owner's entry, no resize

    if (!ggml_gallocr_set_resizable(owner, NULL) ||
        !ggml_gallocr_set_meta_sharing(owner, (enum ggml_gallocr_meta_sharing) sharing)) {
        status = lmws_fail(LMWS_EFAILED, "repro: could not make the owner");
        goto done;
    }
    // with meta buffers private the borrower has nothing to share: it keeps its own buffer
    if (!ggml_gallocr_set_resizable(borrower, owner) && sharing != GGML_GALLOCR_META_PRIVATE) {
        status = lmws_fail(LMWS_EFAILED, "repro: could not attach the borrower");
        goto done;
    }
    // 1. the owner allocates and computes
    if (!ggml_gallocr_alloc_graph(owner, go.graph)) {
        status = lmws_fail(LMWS_ENOMEM, "repro: the owner graph could not be allocated");
        goto done;
    }
    owner_generations[0] = ggml_gallocr_get_generation(owner);
    if ((status = lmws_scale_graph_run(&go, backend, 1.0f, 2.0f, "owner")) != LMWS_OK) {
        goto done;
    }
    // 2. the borrower allocates and computes in the same shared entry
    if (!ggml_gallocr_alloc_graph(borrower, gb.graph)) {
        status = lmws_fail(LMWS_ENOMEM, "repro: the borrower graph could not be allocated");
        goto done;
    }
    if ((status = lmws_scale_graph_run(&gb, backend, 100.0f, 3.0f, "borrower")) != LMWS_OK) {
        goto done;
    }
    // 3. the owner computes again on its reused graph: valid only if its memory was not replaced
    owner_generations[1] = ggml_gallocr_get_generation(owner);
    if (owner_generations[1] != owner_generations[0]) {
        status = lmws_fail(LMWS_EFAILED, "repro: the owner's memory was replaced, its graph cannot be reused");
        goto done;
    }
    status = lmws_scale_graph_run(&go, backend, 7.0f, 2.0f, "owner (reused)");

done:
    ggml_gallocr_free(borrower);
    ggml_gallocr_free(owner);
    ggml_free(gb.ctx);
    ggml_free(go.ctx);
    ggml_backend_free(backend);
    return status;
}

// the alias views the same memory: write through the buffer, read through the alias
int lmws_meta_alias_check(int n_devices, int * alias_of_plain, int * alias_of_alias) {
    ggml_backend_dev_t meta = NULL;
    int status = lmws_cpu_meta_device(n_devices, &meta);
    if (status != LMWS_OK) {
        return status;
    }
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(meta);
    ggml_backend_buffer_t      buf  = ggml_backend_buft_alloc_buffer(buft, 4096);
    if (buf == NULL) {
        return lmws_fail(LMWS_ENOMEM, "alias check: no meta buffer");
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_COMPUTE);
    ggml_backend_buffer_t alias = ggml_backend_meta_buffer_alias(buf);

    // the two refusals: a plain (CPU) buffer and an alias
    ggml_backend_buffer_t plain = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), 64);
    *alias_of_plain = ggml_backend_meta_buffer_alias(plain) != NULL;
    *alias_of_alias = alias != NULL && ggml_backend_meta_buffer_alias(alias) != NULL;
    ggml_backend_buffer_free(plain);

    struct ggml_init_params params = { 4 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * a = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64); // in the buffer
    struct ggml_tensor * b = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64); // in the alias, same offset
    float in[64], out[64];
    for (int i = 0; i < 64; i++) {
        in[i]  = 0.5f * (float) i - 3.0f;
        out[i] = 0.0f;
    }
    status = LMWS_OK;
    if (alias == NULL) {
        status = lmws_fail(LMWS_EFAILED, "alias check: ggml_backend_meta_buffer_alias returned NULL");
    } else if (ggml_backend_tensor_alloc(buf, a, (char *) ggml_backend_buffer_get_base(buf) + 256) != GGML_STATUS_SUCCESS ||
               ggml_backend_tensor_alloc(alias, b, (char *) ggml_backend_buffer_get_base(alias) + 256) != GGML_STATUS_SUCCESS) {
        status = lmws_fail(LMWS_EFAILED, "alias check: tensor allocation failed");
    } else {
        ggml_backend_tensor_set(a, in, 0, sizeof(in));
        ggml_backend_tensor_get(b, out, 0, sizeof(out));
        for (int i = 0; i < 64 && status == LMWS_OK; i++) {
            if (out[i] != in[i]) {
                status = lmws_fail(LMWS_EFAILED, "alias check: read %g through the alias at %d, wrote %g", out[i], i, in[i]);
            }
        }
    }
    ggml_free(ctx);
    ggml_backend_buffer_free(alias); // before the buffer it aliases
    ggml_backend_buffer_free(buf);
    return status;
}
