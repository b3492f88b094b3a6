// llama-metaws shim, C++ side: llama.cpp's memory breakdown of a context, for the planner.
//
// llama_get_memory_breakdown (src/llama-ext.h, a staging header llama.cpp does not install; the
// shim's C++ side compiles with the patched tree's src/ on its include path, so the declarations
// are llama.cpp's own) returns a std::map per buffer type: model bytes, context bytes (KV cache
// and recurrent state) and compute bytes. For a context of a model loaded with
// llama_model_params.no_alloc these are the sizes the allocators would have allocated
// (common/fit.cpp reads them the same way).
// cffi sees only the C entry point below.
#include "shim.h"

#include "llama-ext.h" // llama_get_memory_breakdown, llama_memory_breakdown_data: as llama.cpp declares them

extern "C" int lmws_memory_breakdown(const struct llama_context * ctx, struct lmws_memory_entry * out,
                                     int capacity, int * n) {
    if (ctx == nullptr || n == nullptr || (out == nullptr && capacity > 0)) {
        return lmws_fail_message(LMWS_EINVAL, "memory breakdown: NULL context");
    }
    try {
        const auto breakdown = llama_get_memory_breakdown(ctx);
        int i = 0;
        for (const auto & [buft, mb] : breakdown) {
            if (i < capacity) {
                out[i].buft    = buft;
                out[i].model   = mb.model;
                out[i].context = mb.context;
                out[i].compute = mb.compute;
            }
            i++;
        }
        *n = i; // more than capacity: call again with room for *n
        return LMWS_OK;
    } catch (...) {
        return lmws_fail_message(LMWS_EFAILED, "memory breakdown: llama.cpp threw");
    }
}
