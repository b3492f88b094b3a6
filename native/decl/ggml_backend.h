/* ggml's device registry, as the shim uses it (ggml/include/ggml-backend.h). */

typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;

enum ggml_backend_dev_type {
    GGML_BACKEND_DEVICE_TYPE_CPU,
    GGML_BACKEND_DEVICE_TYPE_GPU,
    GGML_BACKEND_DEVICE_TYPE_IGPU,
    GGML_BACKEND_DEVICE_TYPE_ACCEL,
    ...
};

size_t                     ggml_backend_dev_count(void);
ggml_backend_dev_t         ggml_backend_dev_get(size_t index);
ggml_backend_dev_t         ggml_backend_dev_by_name(const char * name);
const char *               ggml_backend_dev_name(ggml_backend_dev_t device);
const char *               ggml_backend_dev_description(ggml_backend_dev_t device);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
void                       ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);

const char *               ggml_backend_buft_name(ggml_backend_buffer_type_t buft);
ggml_backend_dev_t         ggml_backend_buft_get_device(ggml_backend_buffer_type_t buft);
bool                       ggml_backend_buft_is_host(ggml_backend_buffer_type_t buft);
