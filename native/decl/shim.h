/* The shim's own calls (native/shim.h; values and layout come from there). Every lmws_* call returns an LMWS_* status;
   llama_metaws.errors.check_error turns a negative one into a Python exception carrying
   lmws_last_error(). */

#define LMWS_OK ...
#define LMWS_EINVAL ...
#define LMWS_ERANGE ...
#define LMWS_ENOMEM ...
#define LMWS_ENOTSUP ...
#define LMWS_EFAILED ...

const char * lmws_last_error(void);

struct lmws_compute_buffer {
    ggml_backend_buffer_type_t buft;
    ggml_backend_dev_t         device;   /* the backend's device */
    size_t                     size;     /* bytes allocated now */
    ...;
};

int lmws_n_compute_buffers(const struct llama_context * ctx, int * n);
int lmws_get_compute_buffer(const struct llama_context * ctx, int i, struct lmws_compute_buffer * out);
