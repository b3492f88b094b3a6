// llama-metaws shim, C++ side: which NextN head an MTP context's next decodes run.
//
// A model with several NextN blocks after its trunk (mimo2's three, step35's chained heads) has
// one trained head per draft depth: llama.cpp's draft-mtp (common/speculative.cpp, chain_heads)
// selects head k with llama_set_nextn_layer_offset (src/llama-ext.h, a staging header llama.cpp
// does not install) before draft step k, and head 0 again for the decodes that are not drafts.
// The offset is read when the next graph is built, and an offset past the model's NextN blocks
// fails an assertion there (an abort, far from the call that set it): this call refuses it at
// once, and what llama.cpp throws stays here.
#include "shim.h"

#include "llama-ext.h" // llama_set_nextn_layer_offset: as llama.cpp declares it

#include <string>

extern "C" int lmws_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset) {
    if (ctx == nullptr) {
        return lmws_fail_message(LMWS_EINVAL, "nextn: NULL context");
    }
    try {
        const int32_t n_nextn = llama_model_n_layer_nextn(llama_get_model(ctx));
        if (offset < 0 || offset >= n_nextn) {
            const std::string msg = "nextn: head " + std::to_string(offset) + " is outside the model's " +
                                    std::to_string(n_nextn) + " NextN blocks";
            return lmws_fail_message(LMWS_ERANGE, msg.c_str());
        }
        llama_set_nextn_layer_offset(ctx, offset);
        return LMWS_OK;
    } catch (...) {
        return lmws_fail_message(LMWS_EFAILED, "nextn: llama.cpp threw");
    }
}
