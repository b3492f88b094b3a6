// llama-metaws shim, C++ side: llama.cpp's own fitting of model and context parameters to the
// free device memory (common/fit.h, llama-server's --fit), for -ngl auto and -c 0.
//
// common_fit_params changes only what is still at llama.cpp's defaults: n_gpu_layers (-1), the
// tensor split and the tensor buffer overrides (written into the caller's buffers), and n_ctx when
// it is 0. With an MTP draft context the fit measures it too, as llama-server does for --spec-type
// draft-mtp: on the target's weights (shares_model), or with -md on a draft model of its own file,
// loaded with the target's model params and its NextN blocks. It catches its own runtime errors and returns a
// status; anything else it lets out (std::bad_alloc, a std::logic_error) is caught here.
// The fit logs through llama's log (the callback in place, at GGML_LOG_LEVEL_ERROR or above
// unless verbose) and common's own (its memory tables and its verdict, quiet unless verbose).
#include "shim.h"

#include "fit.h"
#include "log.h"

#include <exception>
#include <string>

extern "C" int lmws_fit_params(const char * path_model, struct llama_model_params * mparams,
                               struct llama_context_params * cparams, float * tensor_split,
                               struct llama_model_tensor_buft_override * overrides, size_t * margins,
                               uint32_t n_ctx_min, const struct llama_context_params * draft_cparams,
                               const char * draft_path, bool verbose, int * status) {
    if (path_model == nullptr || mparams == nullptr || cparams == nullptr || tensor_split == nullptr ||
        overrides == nullptr || margins == nullptr || status == nullptr) {
        return lmws_fail_message(LMWS_EINVAL, "fit: NULL argument");
    }
    const int thold = common_log_get_verbosity_thold();
    common_log_set_verbosity_thold(verbose ? LOG_LEVEL_TRACE : LOG_LEVEL_ERROR);
    int rc = LMWS_OK;
    try {
        llama_model_params   mparams_dft = *mparams; // the draft measures on the weights as they load first
        llama_context_params cparams_dft = draft_cparams ? *draft_cparams : *cparams;
        mparams_dft.load_mtp = mparams_dft.load_mtp || draft_path != nullptr;
        const common_fit_extra_model extra = {draft_path ? draft_path : path_model, &mparams_dft, &cparams_dft,
                                              /*shares_model =*/ draft_path == nullptr};
        *status = (int) common_fit_params(path_model, mparams, cparams, tensor_split, overrides, margins,
                                          n_ctx_min, draft_cparams ? &extra : nullptr,
                                          verbose ? GGML_LOG_LEVEL_DEBUG : GGML_LOG_LEVEL_ERROR);
    } catch (const std::exception & e) {
        rc = lmws_fail_message(LMWS_EFAILED, (std::string("fit: llama.cpp threw: ") + e.what()).c_str());
    } catch (...) {
        rc = lmws_fail_message(LMWS_EFAILED, "fit: llama.cpp threw");
    }
    common_log_set_verbosity_thold(thold);
    return rc;
}
