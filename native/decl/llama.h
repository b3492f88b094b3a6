/* The llama handles the shim takes; they come from the binding as plain addresses. */

struct llama_model;
struct llama_context;
