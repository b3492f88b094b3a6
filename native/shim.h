// llama-metaws shim: a thin C layer over the patched llama.cpp for cffi.
//
// Each lmws_* call checks its arguments, returns an LMWS_* status (0 or negative) and, on a
// failure, records a message that lmws_last_error() returns on the same thread. The Python side
// turns statuses into exceptions in one place (llama_metaws/errors.py).
#pragma once

#include "ggml-backend.h"
#include "llama.h"

#define LMWS_OK          0
#define LMWS_EINVAL     -1
#define LMWS_ERANGE     -2
#define LMWS_ENOMEM     -3
#define LMWS_ENOTSUP    -4
#define LMWS_EFAILED    -5

#ifdef __cplusplus
extern "C" {
#endif

const char * lmws_last_error(void);

struct lmws_compute_buffer {
    ggml_backend_buffer_type_t buft;
    ggml_backend_dev_t         device;
    size_t                     size;
};

int lmws_n_compute_buffers(const struct llama_context * ctx, int * n);
int lmws_get_compute_buffer(const struct llama_context * ctx, int i, struct lmws_compute_buffer * out);

#ifdef __cplusplus
}
#endif
