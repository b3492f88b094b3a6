// llama-metaws shim: ggml's RPC backend (see shim.h). Nothing links to ggml-rpc: its calls come
// from the registry's proc addresses, as llama.cpp's own tools take them.
#include "shim.h"

#include <stdio.h>

typedef ggml_backend_reg_t (*rpc_add_server_fn)(const char * endpoint);
typedef bool (*rpc_server_ok_fn)(const char * endpoint);
typedef void (*rpc_start_server_fn)(const char * endpoint, const char * cache_dir, size_t n_threads,
                                    size_t n_devices, ggml_backend_dev_t * devices);

static void * rpc_proc(const char * name) {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    return reg ? ggml_backend_reg_get_proc_address(reg, name) : NULL;
}

int lmws_rpc_add_server(const char * endpoint, ggml_backend_dev_t * out, int capacity, int * n) {
    if (endpoint == NULL || out == NULL || n == NULL || capacity < 1) {
        return lmws_fail_message(LMWS_EINVAL, "lmws_rpc_add_server: bad arguments");
    }
    rpc_add_server_fn add = (rpc_add_server_fn) rpc_proc("ggml_backend_rpc_add_server");
    if (add == NULL) {
        return lmws_fail_message(LMWS_ENOTSUP, "this build has no RPC backend (GGML_RPC=ON)");
    }
    // patch 0019: NULL, never an abort, when the server cannot be reached (or has no devices)
    ggml_backend_reg_t reg = add(endpoint);
    if (reg == NULL) {
        char msg[300];
        snprintf(msg, sizeof(msg), "RPC server %s: no connection, no handshake or no devices", endpoint);
        return lmws_fail_message(LMWS_EFAILED, msg);
    }
    size_t count = ggml_backend_reg_dev_count(reg);
    if (count > (size_t) capacity) {
        return lmws_fail_message(LMWS_ERANGE, "lmws_rpc_add_server: more devices than capacity");
    }
    for (size_t i = 0; i < count; i++) {
        out[i] = ggml_backend_reg_dev_get(reg, i);
    }
    *n = (int) count;
    return LMWS_OK;
}

int lmws_rpc_register_device(ggml_backend_dev_t dev) {
    if (dev == NULL) {
        return lmws_fail_message(LMWS_EINVAL, "lmws_rpc_register_device: NULL device");
    }
    ggml_backend_device_register(dev);  // ggml_backend_dev_by_name and llama's default list see it
    return LMWS_OK;
}

int lmws_rpc_server_ok(const char * endpoint, bool * ok) {
    if (endpoint == NULL || ok == NULL) {
        return lmws_fail_message(LMWS_EINVAL, "lmws_rpc_server_ok: bad arguments");
    }
    rpc_server_ok_fn fn = (rpc_server_ok_fn) rpc_proc("ggml_backend_rpc_server_ok");
    if (fn == NULL) {
        return lmws_fail_message(LMWS_ENOTSUP, "this build lacks ggml_backend_rpc_server_ok (patch 0019)");
    }
    *ok = fn(endpoint);
    return LMWS_OK;
}

int lmws_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads,
                          ggml_backend_dev_t * devices, size_t n_devices) {
    if (endpoint == NULL || devices == NULL || n_devices == 0) {
        return lmws_fail_message(LMWS_EINVAL, "lmws_rpc_start_server: give an endpoint and devices");
    }
    rpc_start_server_fn start = (rpc_start_server_fn) rpc_proc("ggml_backend_rpc_start_server");
    if (start == NULL) {
        return lmws_fail_message(LMWS_ENOTSUP, "this build has no RPC backend (GGML_RPC=ON)");
    }
    start(endpoint, cache_dir, n_threads, n_devices, devices);  // serves until the process ends
    return lmws_fail_message(LMWS_EFAILED, "the RPC server stopped (could it bind the address?)");
}
