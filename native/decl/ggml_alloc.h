/* ggml-alloc's meta sharing (ggml-alloc.h, patch 0009), for the ggml-level reproduction
   (lmws_repro_meta_shared): llama's own choice is enum llama_workspace_meta_sharing. */

enum ggml_gallocr_meta_sharing {
    GGML_GALLOCR_META_ALIAS,
    GGML_GALLOCR_META_PRIVATE,
    GGML_GALLOCR_META_UNSAFE,
    ...
};
