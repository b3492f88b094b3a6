// llama-metaws shim: see shim.h.
#include "shim.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char lmws_error_msg[512];

const char * lmws_last_error(void) {
    return lmws_error_msg;
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
