"""Every flag of the vendored ``llama-server --help``, and what ``llama-metaws serve`` does with it.

:data:`TABLE` is the one source: :mod:`llama_metaws.cli.flags` registers the refused flags and the
environment variables from it, ``docs/server-flags.md`` is generated from it (:func:`markdown`;
``python -m llama_metaws.cli.server_flags > docs/server-flags.md``), and the tests read it. Each
:class:`Flag` is one option of llama-server's, with its spellings, its value, its ``LLAMA_ARG_*``
variable (``common/arg.cpp``'s ``set_env``) and our verdict:

- ``same``: taken, meaning what it means to llama-server (a default we keep different on purpose
  says so, and why, in ``--help`` and here);
- ``values``: taken for the values the note names, refused (with the reason) for any other;
- ``no effect``: taken, and changes nothing here, because what it tunes does not exist here (the note
  says why that is what llama-server does in the same case);
- ``refused``: an error that names it, says why and what to do instead;
- ``removed``: llama.cpp removed it; refused with llama.cpp's own message.

Where a negative spelling (``--no-...``) gets another verdict than the positive, ``neg_status`` and
``neg_note`` hold it.

llama-server applies its ``LLAMA_ARG_*`` variables first and its command line after them, so a flag
given on the command line wins over its variable; a variable of a switch with a negative spelling
takes a truthy or falsey value (``LLAMA_ARG_NO_*`` set: the negative), one of a switch without
one turns it on when truthy. :func:`env_arguments` does the same for a command's parser.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Dict, Iterable, List, Optional, Tuple

SAME, VALUES, NOOP, REFUSED, REMOVED = "same", "values", "no effect", "refused", "removed"
TAKEN = (SAME, VALUES, NOOP)

#: llama.cpp's spellings of yes, no and auto (common/arg.cpp's is_truthy, is_falsey, is_autoy)
TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")
AUTOY = ("auto", "-1")


@dataclasses.dataclass(frozen=True)
class Flag:
    names: Tuple[str, ...]
    status: str
    note: str = ""
    value: str = ""  # the value's hint in llama-server's --help; "" for a switch
    env: str = ""
    neg: Tuple[str, ...] = ()
    neg_status: Optional[str] = None  # the negative spellings' verdict, where it differs
    neg_note: str = ""
    allowed: Tuple[str, ...] = ()  # ``values``: the values taken

    def takes(self, spelling: str, value: Optional[str] = None) -> bool:
        """Whether serve takes this spelling (with this value, for a ``values`` flag)."""
        status = self.status_of(spelling)
        if status == VALUES and value is not None:
            return value in self.allowed
        return status in TAKEN

    def status_of(self, spelling: str) -> str:
        return self.neg_status if spelling in self.neg and self.neg_status else self.status

    def note_of(self, spelling: str) -> str:
        return self.neg_note if spelling in self.neg and self.neg_status else self.note

    @property
    def spellings(self) -> Tuple[str, ...]:
        return self.names + self.neg

    @property
    def long(self) -> str:
        """The spelling to name it by: its first ``--`` one."""
        return next((s for s in self.names if s.startswith("--")), self.names[0])


def _f(names: str, status: str, note: str = "", *, value: str = "", env: str = "", neg: str = "",
       neg_status: Optional[str] = None, neg_note: str = "", allowed: str = "") -> Flag:
    split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip())  # noqa: E731
    return Flag(split(names), status, note, value, env, split(neg), neg_status, neg_note, split(allowed))


# reasons shared by several flags
DOWNLOADS = "llama-metaws serve downloads nothing: give -m a local GGUF file"
PLACEMENT = ("the CPU placement, priority and polling of llama.cpp's thread pools are not reachable through "
             "the binding: pin the process with taskset or numactl")
DRAFT_THREADS = "the MTP draft context computes with the target's threads (its context params are the target's)"
DRAFT_WEIGHTS = ("the MTP draft context runs on the target's weights and devices, and a -md draft model is placed "
                 "as the target is: place the target (-dev, -ngl, -sm, -ts)")
DRAFT_MODEL = ("an MTP head of its own file (mtp-*.gguf, convert_hf_to_gguf.py --mtp) or a Gemma 4 assistant, "
               "loaded as an MTP context beside the target; draft-mtp is inferred from the file where --spec-type "
               "is none (for an assistant too, which llama-server leaves unused then); any other draft model "
               "(draft-simple, EAGLE-3, DFlash) is refused when the model loads, naming the file")
LOOKUP = "lookup decoding is not implemented: speculative decoding here is --spec-type draft-mtp"
NGRAM = "n-gram speculative decoding is not implemented: use --spec-type draft-mtp with an MTP model"
MULTIMODAL = "multimodal input is not served: no projector is loaded here; serve a text model"
EMBEDDINGS = "this server generates text; it has no embedding or reranking endpoints"
ADAPTERS = "adapters (LoRA, control vectors) are not supported by llama-metaws serve"
OVERRIDES = "not yet: tensor buffer overrides are not taken; place layers with -ngl, -ts or --fit"
ROUTER = "llama-server's router mode (several models behind one server) is not supported: run a serve per model"
AGENT = "llama-server's web UI agent features (built-in tools, MCP servers, the CORS proxy) are not supported"
LOG_FILE = "serve logs to stderr (-v adds llama.cpp's log): redirect it"
PRESET = "a preset downloads its model: llama-metaws serve downloads nothing; give -m a local GGUF file and the flags"
NO_PROJECTOR = "no projector is ever loaded here, as with this flag"


def _sampling(field: str) -> str:
    return (f"a server-wide sampling default: serve's are --temp, -s and -n; send \"{field}\" in each "
            f"request instead")


TABLE: Tuple[Flag, ...] = (
    _f("-h, --help, --usage", SAME),
    _f("--version", SAME, "prints llama-metaws's version and its build of llama.cpp"),
    _f("-cl, --cache-list", REFUSED, "no model cache: " + DOWNLOADS),
    _f("--completion-bash", REFUSED, "no completion script is generated"),
    _f("-t, --threads", SAME, "default: the binding's (half the logical cores, about the physical ones), not "
       "llama.cpp's -1", value="N", env="LLAMA_ARG_THREADS"),
    _f("-tb, --threads-batch", SAME, value="N"),
    _f("-C, --cpu-mask", REFUSED, PLACEMENT, value="M"),
    _f("-Cr, --cpu-range", REFUSED, PLACEMENT, value="lo-hi"),
    _f("--cpu-strict", REFUSED, PLACEMENT, value="<0|1>"),
    _f("--prio", REFUSED, PLACEMENT, value="N"),
    _f("--poll", REFUSED, PLACEMENT, value="<0...100>"),
    _f("-Cb, --cpu-mask-batch", REFUSED, PLACEMENT, value="M"),
    _f("-Crb, --cpu-range-batch", REFUSED, PLACEMENT, value="lo-hi"),
    _f("--cpu-strict-batch", REFUSED, PLACEMENT, value="<0|1>"),
    _f("--prio-batch", REFUSED, PLACEMENT, value="N"),
    _f("--poll-batch", REFUSED, PLACEMENT, value="<0|1>"),
    _f("-lcs, --lookup-cache-static", REFUSED, LOOKUP, value="FNAME"),
    _f("-lcd, --lookup-cache-dynamic", REFUSED, LOOKUP, value="FNAME"),
    _f("-c, --ctx-size", SAME, "default 0: the model's context, fitted (--fit), a slot's share of it without "
       "-kvu", value="N", env="LLAMA_ARG_CTX_SIZE"),
    _f("--kv-unified-per-slot", REFUSED, "not yet: size the context with -c (-kvu: every slot may use all of "
       "it)", value="N", env="LLAMA_ARG_KV_UNIFIED_PER_SLOT"),
    _f("-n, --predict, --n-predict", SAME, "default: each API's (16 on /v1/completions), as a request that sets "
       "nothing expects of its API, not -1", value="N", env="LLAMA_ARG_N_PREDICT"),
    _f("-b, --batch-size", SAME, value="N", env="LLAMA_ARG_BATCH"),
    _f("-ub, --ubatch-size", SAME, value="N", env="LLAMA_ARG_UBATCH"),
    _f("--keep", VALUES, "0 only (the default): a context shift keeps the BOS and drops half of the rest",
       value="N", allowed="0"),
    _f("--swa-full", SAME, env="LLAMA_ARG_SWA_FULL"),
    _f("-ctxcp, --ctx-checkpoints, --swa-checkpoints", SAME, "checkpoints of a recurrent or hybrid target's "
       "state per slot", value="N", env="LLAMA_ARG_CTX_CHECKPOINTS"),
    _f("-cms, --checkpoint-min-step", SAME, "a checkpoint every N tokens of a long prompt (this server sees "
       "tokens, not llama-server's user-message starts); 0: at the end of every prompt chunk",
       value="N", env="LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT"),
    _f("-cram, --cache-ram", VALUES, "0 only: there is no host-memory prompt cache across slots here (each slot "
       "reuses its own prompt and checkpoints)", value="N", env="LLAMA_ARG_CACHE_RAM", allowed="0"),
    _f("-kvu, --kv-unified", SAME, "default: on where -np is auto (4 slots), as llama-server's; a -no-kvu "
       "given beside -np auto is kept", env="LLAMA_ARG_KV_UNIFIED", neg="-no-kvu, --no-kv-unified"),
    _f("--cache-idle-slots", NOOP, "there is no host-memory prompt cache to save idle slots to (as llama-server "
       "with -cram 0)", env="LLAMA_ARG_CACHE_IDLE_SLOTS", neg="--no-cache-idle-slots"),
    _f("--context-shift", SAME, env="LLAMA_ARG_CONTEXT_SHIFT", neg="--no-context-shift"),
    _f("-fa, --flash-attn", SAME, value="[on|off|auto]", env="LLAMA_ARG_FLASH_ATTN"),
    _f("--perf", SAME, env="LLAMA_ARG_PERF", neg="--no-perf"),
    _f("-e, --escape", NOOP, "llama-server escapes only its prompt, reverse prompts and DRY breakers, which serve "
       "does not take", neg="--no-escape"),
    _f("-r, --reverse-prompt", REFUSED, "a server-wide default stop string: send \"stop\" in each request",
       value="PROMPT"),
    _f("-sp, --special", REFUSED, "not yet: whether special tokens show in the text is not set server-wide"),
    _f("--warmup", NOOP, "serve never decodes a warm-up batch (as with --no-warmup): the first request pays for "
       "it", neg="--no-warmup"),
    _f("--spm-infill", SAME),
    _f("--samplers", REFUSED, _sampling("samplers"), value="SAMPLERS"),
    _f("-s, --seed", SAME, value="SEED"),
    _f("--sampler-seq, --sampling-seq", REFUSED, _sampling("samplers"), value="SEQUENCE"),
    _f("--ignore-eos", REFUSED, _sampling("ignore_eos")),
    _f("--temp, --temperature", SAME, value="N", env="LLAMA_ARG_TEMPERATURE"),
    _f("--top-k", REFUSED, _sampling("top_k"), value="N", env="LLAMA_ARG_TOP_K"),
    _f("--top-p", REFUSED, _sampling("top_p"), value="N", env="LLAMA_ARG_TOP_P"),
    _f("--min-p", REFUSED, _sampling("min_p"), value="N", env="LLAMA_ARG_MIN_P"),
    _f("--top-nsigma, --top-n-sigma", REFUSED, _sampling("top_n_sigma"), value="N"),
    _f("--xtc-probability", REFUSED, _sampling("xtc_probability"), value="N"),
    _f("--xtc-threshold", REFUSED, _sampling("xtc_threshold"), value="N"),
    _f("--typical, --typical-p", REFUSED, _sampling("typical_p"), value="N"),
    _f("--repeat-last-n", REFUSED, _sampling("repeat_last_n"), value="N"),
    _f("--repeat-penalty", REFUSED, _sampling("repeat_penalty"), value="N",
       env="LLAMA_ARG_REPEAT_PENALTY"),
    _f("--presence-penalty", REFUSED, _sampling("presence_penalty"), value="N",
       env="LLAMA_ARG_PRESENCE_PENALTY"),
    _f("--frequency-penalty", REFUSED, _sampling("frequency_penalty"), value="N",
       env="LLAMA_ARG_FREQUENCY_PENALTY"),
    _f("--dry-multiplier", REFUSED, "DRY sampling is not implemented", value="N"),
    _f("--dry-base", REFUSED, "DRY sampling is not implemented", value="N"),
    _f("--dry-allowed-length", REFUSED, "DRY sampling is not implemented", value="N"),
    _f("--dry-penalty-last-n", REFUSED, "DRY sampling is not implemented", value="N"),
    _f("--dry-sequence-breaker", REFUSED, "DRY sampling is not implemented", value="STRING"),
    _f("--adaptive-target", REFUSED, "adaptive-p sampling is not implemented", value="N"),
    _f("--adaptive-decay", REFUSED, "adaptive-p sampling is not implemented", value="N"),
    _f("--dynatemp-range", REFUSED, _sampling("dynatemp_range"), value="N"),
    _f("--dynatemp-exp", REFUSED, _sampling("dynatemp_exponent"), value="N"),
    _f("--mirostat", REFUSED, _sampling("mirostat"), value="N"),
    _f("--mirostat-lr", REFUSED, _sampling("mirostat_eta"), value="N"),
    _f("--mirostat-ent", REFUSED, _sampling("mirostat_tau"), value="N"),
    _f("-l, --logit-bias", REFUSED, _sampling("logit_bias"), value="TOKEN_ID(+/-)BIAS"),
    _f("--grammar", REFUSED, "a server-wide grammar: send \"grammar\" in each request", value="GRAMMAR"),
    _f("--grammar-file", REFUSED, "a server-wide grammar: send \"grammar\" in each request", value="FNAME"),
    _f("-j, --json-schema", REFUSED, "a server-wide JSON schema: send \"json_schema\" (or response_format) in each "
       "request", value="SCHEMA"),
    _f("-jf, --json-schema-file", REFUSED, "a server-wide JSON schema: send \"json_schema\" (or response_format) "
       "in each request", value="FILE"),
    _f("-bs, --backend-sampling", REFUSED, "sampling runs on the CPU from the logits here; backend samplers are "
       "not set up", env="LLAMA_ARG_BACKEND_SAMPLING"),
    _f("--pooling", REFUSED, EMBEDDINGS, value="{none,mean,cls,last,rank}", env="LLAMA_ARG_POOLING"),
    _f("--rope-scaling", SAME, value="{none,linear,yarn}", env="LLAMA_ARG_ROPE_SCALING_TYPE"),
    _f("--rope-scale", SAME, value="N", env="LLAMA_ARG_ROPE_SCALE"),
    _f("--rope-freq-base", SAME, value="N", env="LLAMA_ARG_ROPE_FREQ_BASE"),
    _f("--rope-freq-scale", SAME, value="N", env="LLAMA_ARG_ROPE_FREQ_SCALE"),
    _f("--yarn-orig-ctx", SAME, value="N", env="LLAMA_ARG_YARN_ORIG_CTX"),
    _f("--yarn-ext-factor", SAME, value="N", env="LLAMA_ARG_YARN_EXT_FACTOR"),
    _f("--yarn-attn-factor", SAME, value="N", env="LLAMA_ARG_YARN_ATTN_FACTOR"),
    _f("--yarn-beta-slow", SAME, value="N", env="LLAMA_ARG_YARN_BETA_SLOW"),
    _f("--yarn-beta-fast", SAME, value="N", env="LLAMA_ARG_YARN_BETA_FAST"),
    _f("-kvo, --kv-offload", SAME, env="LLAMA_ARG_KV_OFFLOAD", neg="-nkvo, --no-kv-offload"),
    _f("--repack", SAME, env="LLAMA_ARG_REPACK", neg="-nr, --no-repack"),
    _f("--no-host", SAME, env="LLAMA_ARG_NO_HOST"),
    _f("-ctk, --cache-type-k", SAME, value="TYPE", env="LLAMA_ARG_CACHE_TYPE_K"),
    _f("-ctv, --cache-type-v", SAME, value="TYPE", env="LLAMA_ARG_CACHE_TYPE_V"),
    _f("-dt, --defrag-thold", NOOP, "deprecated in llama.cpp, which ignores it with a warning", value="N",
       env="LLAMA_ARG_DEFRAG_THOLD"),
    _f("-np, --parallel", SAME, "default -1, auto: 4 slots with a unified KV, as llama-server resolves it",
       value="N", env="LLAMA_ARG_N_PARALLEL"),
    _f("-cb, --cont-batching", SAME, "continuous batching is how the engine always runs", env="LLAMA_ARG_CONT_BATCHING",
       neg="-nocb, --no-cont-batching", neg_status=REFUSED,
       neg_note="the engine always batches every running request into one step (continuous batching); "
       "-np 1 runs one request at a time"),
    _f("-mm, --mmproj", REFUSED, MULTIMODAL, value="FILE", env="LLAMA_ARG_MMPROJ"),
    _f("-mmu, --mmproj-url", REFUSED, MULTIMODAL, value="URL", env="LLAMA_ARG_MMPROJ_URL"),
    _f("--mmproj-auto", REFUSED, MULTIMODAL, env="LLAMA_ARG_MMPROJ_AUTO", neg="--no-mmproj, --no-mmproj-auto",
       neg_status=NOOP, neg_note=NO_PROJECTOR),
    _f("--mmproj-offload", REFUSED, MULTIMODAL, env="LLAMA_ARG_MMPROJ_OFFLOAD", neg="--no-mmproj-offload"),
    _f("-mmdev, --mmproj-device", REFUSED, MULTIMODAL, value="DEVICE", env="MTMD_BACKEND_DEVICE"),
    _f("--image-min-tokens", REFUSED, MULTIMODAL, value="N", env="LLAMA_ARG_IMAGE_MIN_TOKENS"),
    _f("--image-max-tokens", REFUSED, MULTIMODAL, value="N", env="LLAMA_ARG_IMAGE_MAX_TOKENS"),
    _f("--mtmd-batch-max-tokens", REFUSED, MULTIMODAL, value="N", env="LLAMA_ARG_MTMD_BATCH_MAX_TOKENS"),
    _f("--video-fps", REFUSED, MULTIMODAL, value="N", env="LLAMA_ARG_VIDEO_FPS"),
    _f("--video-timestamp-interval", REFUSED, MULTIMODAL, value="N", env="LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL"),
    _f("--video-ffmpeg-dir", REFUSED, MULTIMODAL, value="DIR", env="LLAMA_ARG_VIDEO_FFMPEG_DIR"),
    _f("--rpc", SAME, "servers of llama-metaws rpc-server (ggml's RPC protocol)", value="SERVERS", env="LLAMA_ARG_RPC"),
    _f("-lm, --load-mode", SAME, value="MODE", env="LLAMA_ARG_LOAD_MODE"),
    _f("-lzm, --lazy-mode", SAME, value="MODE", env="LLAMA_ARG_LAZY_MODE"),
    _f("--numa", SAME, value="TYPE", env="LLAMA_ARG_NUMA"),
    _f("-dev, --device", SAME, value="<dev1,dev2,..>", env="LLAMA_ARG_DEVICE"),
    _f("--list-devices", SAME),
    _f("-ot, --override-tensor", REFUSED, OVERRIDES, value="<tensor name pattern>=<buffer type>,...",
       env="LLAMA_ARG_OVERRIDE_TENSOR"),
    _f("-cmoe, --cpu-moe", REFUSED, OVERRIDES, env="LLAMA_ARG_CPU_MOE"),
    _f("-ncmoe, --n-cpu-moe", REFUSED, OVERRIDES, value="N", env="LLAMA_ARG_N_CPU_MOE"),
    _f("-ncffn, --n-cpu-ffn", REFUSED, OVERRIDES, value="N", env="LLAMA_ARG_N_CPU_FFN"),
    _f("-ngl, --gpu-layers, --n-gpu-layers", SAME, "default auto: fitted by llama.cpp's own fit (--fit); on a "
       "CPU-only build every layer, on the CPU", value="N", env="LLAMA_ARG_N_GPU_LAYERS"),
    _f("-sm, --split-mode", SAME, value="{none,layer,row,tensor}", env="LLAMA_ARG_SPLIT_MODE"),
    _f("-ts, --tensor-split", SAME, value="N0,N1,N2,...", env="LLAMA_ARG_TENSOR_SPLIT"),
    _f("-mg, --main-gpu", SAME, value="INDEX", env="LLAMA_ARG_MAIN_GPU"),
    _f("-fit, --fit", SAME, "llama.cpp's common_fit_params, through the shim (the MTP draft context fitted "
       "with the target)", value="[on|off]", env="LLAMA_ARG_FIT"),
    _f("-fitt, --fit-target", SAME, value="MiB0,MiB1,MiB2,...", env="LLAMA_ARG_FIT_TARGET"),
    _f("-fitc, --fit-ctx", SAME, value="N", env="LLAMA_ARG_FIT_CTX"),
    _f("--check-tensors", SAME),
    _f("--override-kv", SAME, value="KEY=TYPE:VALUE,..."),
    _f("--op-offload", SAME, neg="--no-op-offload"),
    _f("--lora", REFUSED, ADAPTERS, value="FNAME"),
    _f("--lora-scaled", REFUSED, ADAPTERS, value="FNAME:SCALE,..."),
    _f("--control-vector", REFUSED, ADAPTERS, value="FNAME"),
    _f("--control-vector-scaled", REFUSED, ADAPTERS, value="FNAME:SCALE,..."),
    _f("--control-vector-layer-range", REFUSED, ADAPTERS, value="START"),
    _f("-a, --alias", SAME, value="STRING", env="LLAMA_ARG_ALIAS"),
    _f("--tags", SAME, value="STRING", env="LLAMA_ARG_TAGS"),
    _f("-m, --model", SAME, value="FNAME", env="LLAMA_ARG_MODEL"),
    _f("-mu, --model-url", REFUSED, DOWNLOADS, value="MODEL_URL", env="LLAMA_ARG_MODEL_URL"),
    _f("-dr, --docker-repo", REFUSED, DOWNLOADS, value="[<repo>/]<model>[:quant]", env="LLAMA_ARG_DOCKER_REPO"),
    _f("-hf, -hfr, --hf-repo", REFUSED, DOWNLOADS, value="<user>/<model>[:quant]", env="LLAMA_ARG_HF_REPO"),
    _f("-hff, --hf-file", REFUSED, DOWNLOADS, value="FILE", env="LLAMA_ARG_HF_FILE"),
    _f("-hft, --hf-token", REFUSED, DOWNLOADS, value="TOKEN", env="HF_TOKEN"),
    _f("--embd-normalize", REFUSED, EMBEDDINGS, value="N"),
    _f("--host", SAME, "TCP addresses (a UNIX socket path ending in .sock is refused)", value="HOST",
       env="LLAMA_ARG_HOST"),
    _f("--port", SAME, value="PORT", env="LLAMA_ARG_PORT"),
    _f("--reuse-port", SAME, env="LLAMA_ARG_REUSE_PORT"),
    _f("--path", REFUSED, "no static files are served: / is serve's own chat page (--no-ui: none)", value="PATH",
       env="LLAMA_ARG_STATIC_PATH"),
    _f("--cors-origins", SAME, value="ORIGINS", env="LLAMA_ARG_CORS_ORIGINS"),
    _f("--cors-methods", SAME, value="METHODS", env="LLAMA_ARG_CORS_METHODS"),
    _f("--cors-headers", SAME, value="HEADERS", env="LLAMA_ARG_CORS_HEADERS"),
    _f("--cors-credentials", SAME, env="LLAMA_ARG_CORS_CREDENTIALS", neg="--no-cors-credentials"),
    _f("--api-prefix", REFUSED, "routes are served at the root: put a reverse proxy in front for a prefix",
       value="PREFIX", env="LLAMA_ARG_API_PREFIX"),
    _f("--ui-config, --webui-config", REFUSED, "the page at / is serve's own, not llama-server's web UI",
       value="JSON", env="LLAMA_ARG_UI_CONFIG"),
    _f("--ui-config-file, --webui-config-file", REFUSED, "the page at / is serve's own, not llama-server's web UI",
       value="PATH", env="LLAMA_ARG_UI_CONFIG_FILE"),
    _f("--ui-mcp-proxy, --webui-mcp-proxy", REFUSED, AGENT, env="LLAMA_ARG_UI_MCP_PROXY",
       neg="--no-ui-mcp-proxy, --no-webui-mcp-proxy", neg_status=NOOP, neg_note="there is no proxy to turn off"),
    _f("--tools", REFUSED, AGENT, value="TOOL1,TOOL2,...", env="LLAMA_ARG_TOOLS"),
    _f("--tools-runtime", REFUSED, AGENT, value="OPTION", env="LLAMA_ARG_TOOLS_RUNTIME"),
    _f("--mcp-servers-config", REFUSED, AGENT, value="PATH", env="LLAMA_ARG_MCP_SERVERS_CONFIG"),
    _f("--mcp-servers-json", REFUSED, AGENT, value="JSON", env="LLAMA_ARG_MCP_SERVERS_JSON"),
    _f("-ag, --agent", REFUSED, AGENT, env="LLAMA_ARG_AGENT", neg="-no-ag, --no-agent", neg_status=NOOP,
       neg_note="there are no agent features to turn off"),
    _f("--ui, --webui", SAME, "the page is serve's own chat page", env="LLAMA_ARG_UI", neg="--no-ui, --no-webui"),
    _f("--embedding, --embeddings", REFUSED, EMBEDDINGS, env="LLAMA_ARG_EMBEDDINGS"),
    _f("--rerank, --reranking", REFUSED, EMBEDDINGS, env="LLAMA_ARG_RERANKING"),
    _f("--api-key", SAME, "one key, or several comma-separated", value="KEY", env="LLAMA_API_KEY"),
    _f("--api-key-file", SAME, value="FNAME", env="LLAMA_ARG_API_KEY_FILE"),
    _f("--ssl-key-file", REFUSED, "no TLS here: put a TLS-terminating proxy in front", value="FNAME",
       env="LLAMA_ARG_SSL_KEY_FILE"),
    _f("--ssl-cert-file", REFUSED, "no TLS here: put a TLS-terminating proxy in front", value="FNAME",
       env="LLAMA_ARG_SSL_CERT_FILE"),
    _f("--chat-template-kwargs", SAME, value="STRING", env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS"),
    _f("-to, --timeout", REFUSED, "no server-side read/write timeout is set: a client that goes away cancels its "
       "request", value="N", env="LLAMA_ARG_TIMEOUT"),
    _f("--sse-ping-interval", VALUES, "-1 only: streams carry no pings here", value="N",
       env="LLAMA_ARG_SSE_PING_INTERVAL", allowed="-1"),
    _f("--threads-http", NOOP, "HTTP is served by one asyncio event loop; the model runs on the engine's "
       "threads (-t, -tb)", value="N", env="LLAMA_ARG_THREADS_HTTP"),
    _f("--cache-prompt", SAME, "the default of each request's \"cache_prompt\"", env="LLAMA_ARG_CACHE_PROMPT",
       neg="--no-cache-prompt"),
    _f("--cache-reuse", VALUES, "0 only (the default): a prompt is reused as a prefix, never by shifting KV "
       "chunks", value="N", env="LLAMA_ARG_CACHE_REUSE", allowed="0"),
    _f("--metrics", SAME, "llama-server's counters and the engine's and the workspace's gauges",
       env="LLAMA_ARG_ENDPOINT_METRICS"),
    _f("--props", REFUSED, "POST /props changes nothing here: GET /props is always served",
       env="LLAMA_ARG_ENDPOINT_PROPS"),
    _f("--slots", SAME, env="LLAMA_ARG_ENDPOINT_SLOTS", neg="--no-slots"),
    _f("--slot-save-path", SAME, value="PATH"),
    _f("--media-path", REFUSED, MULTIMODAL, value="PATH"),
    _f("--models-dir", REFUSED, ROUTER, value="PATH", env="LLAMA_ARG_MODELS_DIR"),
    _f("--models-preset", REFUSED, ROUTER, value="PATH", env="LLAMA_ARG_MODELS_PRESET"),
    _f("--models-max", REFUSED, ROUTER, value="N", env="LLAMA_ARG_MODELS_MAX"),
    _f("--models-autoload", NOOP, "only the router mode loads models on demand; this server serves one",
       env="LLAMA_ARG_MODELS_AUTOLOAD", neg="--no-models-autoload"),
    _f("--jinja", SAME, env="LLAMA_ARG_JINJA", neg="--no-jinja"),
    _f("--reasoning-format", SAME, value="FORMAT", env="LLAMA_ARG_THINK"),
    _f("-rea, --reasoning", SAME, value="[on|off|auto]", env="LLAMA_ARG_REASONING"),
    _f("--reasoning-effort", REFUSED, "not yet: send \"reasoning_effort\" in --chat-template-kwargs or the "
       "request's chat_template_kwargs", value="LEVEL", env="LLAMA_ARG_REASONING_EFFORT"),
    _f("--reasoning-budget", SAME, value="N", env="LLAMA_ARG_THINK_BUDGET"),
    _f("--reasoning-budget-message", SAME, value="MESSAGE", env="LLAMA_ARG_THINK_BUDGET_MESSAGE"),
    _f("--reasoning-preserve", REFUSED, "not yet: the chat template decides which reasoning it keeps",
       env="LLAMA_ARG_REASONING_PRESERVE", neg="--no-reasoning-preserve"),
    _f("--chat-template", SAME, value="JINJA_TEMPLATE", env="LLAMA_ARG_CHAT_TEMPLATE"),
    _f("--chat-template-file", SAME, value="JINJA_TEMPLATE_FILE", env="LLAMA_ARG_CHAT_TEMPLATE_FILE"),
    _f("--skip-chat-parsing", REFUSED, "not yet: answers are always parsed by the template's parser",
       env="LLAMA_ARG_SKIP_CHAT_PARSING", neg="--no-skip-chat-parsing", neg_status=NOOP,
       neg_note="answers are parsed, as without --skip-chat-parsing"),
    _f("--prefill-assistant", SAME, env="LLAMA_ARG_PREFILL_ASSISTANT", neg="--no-prefill-assistant"),
    _f("-sps, --slot-prompt-similarity", REFUSED, "a request goes to the free slot holding the longest common "
       "prefix of its prompt; no similarity threshold is taken", value="SIMILARITY"),
    _f("--lora-init-without-apply", REFUSED, ADAPTERS),
    _f("--sleep-idle-seconds", VALUES, "-1 only (the default): the model stays loaded", value="SECONDS",
       allowed="-1"),
    _f("--log-disable", NOOP, "serve's own log is a few lines on stderr; llama.cpp's shows with -v only"),
    _f("--log-file", REFUSED, LOG_FILE, value="FNAME", env="LLAMA_ARG_LOG_FILE"),
    _f("--log-jsonl", REFUSED, "serve's log is plain lines on stderr", env="LLAMA_ARG_LOG_JSONL",
       neg="--no-log-jsonl", neg_status=NOOP, neg_note="serve's log is plain lines already"),
    _f("--log-prompts-dir", REFUSED, "prompts are not logged to files: -v puts llama-server's __verbose in each "
       "answer", value="PATH"),
    _f("--log-colors", NOOP, "serve's log has no colors", value="[on|off|auto]", env="LLAMA_ARG_LOG_COLORS"),
    _f("-v, --verbose, --log-verbose", SAME, "llama.cpp's log on stderr, and llama-server's __verbose in each answer"),
    _f("--offline", NOOP, "serve never uses the network to find a model", env="LLAMA_ARG_OFFLINE"),
    _f("-lv, --verbosity, --log-verbosity", NOOP, "-v or nothing: serve's log has no levels", value="N",
       env="LLAMA_ARG_LOG_VERBOSITY"),
    _f("--log-prefix", NOOP, "serve's log lines carry no prefix", env="LLAMA_ARG_LOG_PREFIX", neg="--no-log-prefix"),
    _f("--log-timestamps", NOOP, "serve's log lines carry no timestamps", env="LLAMA_ARG_LOG_TIMESTAMPS",
       neg="--no-log-timestamps"),
    _f("--spec-draft-hf, -hfd, -hfrd, --hf-repo-draft", REFUSED, DOWNLOADS, value="<user>/<model>[:quant]",
       env="LLAMA_ARG_SPEC_DRAFT_HF_REPO"),
    _f("--spec-draft-threads, -td, --threads-draft", REFUSED, DRAFT_THREADS, value="N"),
    _f("--spec-draft-threads-batch, -tbd, --threads-batch-draft", REFUSED, DRAFT_THREADS, value="N"),
    _f("--spec-draft-cpu-mask, -Cd, --cpu-mask-draft", REFUSED, PLACEMENT, value="M"),
    _f("--spec-draft-cpu-range, -Crd, --cpu-range-draft", REFUSED, PLACEMENT, value="lo-hi"),
    _f("--spec-draft-cpu-strict, --cpu-strict-draft", REFUSED, PLACEMENT, value="<0|1>"),
    _f("--spec-draft-prio, --prio-draft", REFUSED, PLACEMENT, value="N"),
    _f("--spec-draft-poll, --poll-draft", REFUSED, PLACEMENT, value="<0|1>"),
    _f("--spec-draft-cpu-mask-batch, -Cbd, --cpu-mask-batch-draft", REFUSED, PLACEMENT, value="M"),
    _f("--spec-draft-cpu-strict-batch, --cpu-strict-batch-draft", REFUSED, PLACEMENT, value="<0|1>"),
    _f("--spec-draft-prio-batch, --prio-batch-draft", REFUSED, PLACEMENT, value="N"),
    _f("--spec-draft-poll-batch, --poll-batch-draft", REFUSED, PLACEMENT, value="<0|1>"),
    _f("--spec-draft-type-k, -ctkd, --cache-type-k-draft", REFUSED, "the MTP draft context takes the target's KV "
       "cache types (-ctk, -ctv)", value="TYPE", env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K"),
    _f("--spec-draft-type-v, -ctvd, --cache-type-v-draft", REFUSED, "the MTP draft context takes the target's KV "
       "cache types (-ctk, -ctv)", value="TYPE", env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V"),
    _f("--spec-draft-override-tensor, -otd, --override-tensor-draft", REFUSED, DRAFT_WEIGHTS,
       value="<tensor name pattern>=<buffer type>,..."),
    _f("--spec-draft-cpu-moe, -cmoed, --cpu-moe-draft", REFUSED, DRAFT_WEIGHTS, env="LLAMA_ARG_SPEC_DRAFT_CPU_MOE"),
    _f("--spec-draft-n-cpu-moe, --spec-draft-ncmoe, -ncmoed, --n-cpu-moe-draft", REFUSED, DRAFT_WEIGHTS, value="N",
       env="LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE"),
    _f("--spec-draft-n-max", SAME, "also auto: a length chosen per step and slot", value="N",
       env="LLAMA_ARG_SPEC_DRAFT_N_MAX"),
    _f("--spec-draft-n-min", VALUES, "0 only (the default): a step drafts 0 to --spec-draft-n-max tokens",
       value="N", env="LLAMA_ARG_SPEC_DRAFT_N_MIN", allowed="0"),
    _f("--spec-synth-len", SAME, value="L", env="LLAMA_ARG_SPEC_SYNTH_LEN"),
    _f("--spec-synth-rates", SAME, value="P0,P1,...", env="LLAMA_ARG_SPEC_SYNTH_RATES"),
    _f("--spec-draft-p-split, --draft-p-split", REFUSED, "tree drafts (split branches) are not implemented: "
       "a draft is one chain", value="P", env="LLAMA_ARG_SPEC_DRAFT_P_SPLIT"),
    _f("--spec-draft-p-min, --draft-p-min", SAME, value="P", env="LLAMA_ARG_SPEC_DRAFT_P_MIN"),
    _f("--spec-draft-backend-sampling", REFUSED, "the MTP head's drafts are sampled on the CPU from its logits",
       env="LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING", neg="--no-spec-draft-backend-sampling", neg_status=NOOP,
       neg_note="draft sampling is on the CPU already"),
    _f("--spec-draft-device, -devd, --device-draft", REFUSED, DRAFT_WEIGHTS, value="<dev1,dev2,..>"),
    _f("--spec-draft-ngl, -ngld, --gpu-layers-draft, --n-gpu-layers-draft", REFUSED, DRAFT_WEIGHTS, value="N",
       env="LLAMA_ARG_N_GPU_LAYERS_DRAFT"),
    _f("--spec-draft-model, -md, --model-draft", SAME, DRAFT_MODEL, value="FNAME", env="LLAMA_ARG_SPEC_DRAFT_MODEL"),
    _f("--spec-type", VALUES, "none and draft-mtp (the model's own MTP head, or -md's); the other types are not "
       "implemented",
       value="none,draft-simple,draft-eagle3,draft-mtp,draft-dflash,draft-dspark,ngram-simple,ngram-map-k,"
       "ngram-map-k4v,ngram-mod,ngram-cache", env="LLAMA_ARG_SPEC_TYPE", allowed="none, draft-mtp"),
    _f("--spec-ngram-mod-n-min", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-mod-n-max", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-mod-n-match", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-simple-size-n", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-simple-size-m", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-simple-min-hits", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-map-k-size-n", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-map-k-size-m", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-map-k-min-hits", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-map-k4v-size-n", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-map-k4v-size-m", REFUSED, NGRAM, value="N"),
    _f("--spec-ngram-map-k4v-min-hits", REFUSED, NGRAM, value="N"),
    _f("--draft, --draft-n, --draft-max", REMOVED, "the argument has been removed. use --spec-draft-n-max or "
       "--spec-ngram-mod-n-max", value="N", env="LLAMA_ARG_DRAFT_MAX"),
    _f("--draft-min, --draft-n-min", REMOVED, "the argument has been removed. use --spec-draft-n-min or "
       "--spec-ngram-mod-n-min", value="N", env="LLAMA_ARG_DRAFT_MIN"),
    _f("--spec-ngram-size-n", REMOVED, "the argument has been removed. use the respective --spec-ngram-*-size-n",
       value="N"),
    _f("--spec-ngram-size-m", REMOVED, "the argument has been removed. use the respective --spec-ngram-*-size-m",
       value="N"),
    _f("--spec-ngram-min-hits", REMOVED, "the argument has been removed. use the respective "
       "--spec-ngram-*-min-hits", value="N"),
    _f("--embd-gemma-default", REFUSED, PRESET),
    _f("--fim-qwen-1.5b-default", REFUSED, PRESET),
    _f("--fim-qwen-3b-default", REFUSED, PRESET),
    _f("--fim-qwen-7b-default", REFUSED, PRESET),
    _f("--fim-qwen-7b-spec", REFUSED, PRESET),
    _f("--fim-qwen-14b-spec", REFUSED, PRESET),
    _f("--fim-qwen-30b-default", REFUSED, PRESET),
    _f("--gpt-oss-20b-default", REFUSED, PRESET),
    _f("--gpt-oss-120b-default", REFUSED, PRESET),
    _f("--vision-gemma-4b-default", REFUSED, PRESET),
    _f("--vision-gemma-12b-default", REFUSED, PRESET),
    _f("--spec-default", REFUSED, PRESET),
)

#: every spelling -> its row
BY_SPELLING: Dict[str, Flag] = {s: f for f in TABLE for s in f.spellings}


def refusal(spelling: str) -> Optional[str]:
    """The error for a refused or removed spelling of llama-server's; None for one serve takes."""
    flag = BY_SPELLING.get(spelling)
    if flag is None or flag.status_of(spelling) in TAKEN:
        return None
    return flag.note_of(spelling)


class EnvError(ValueError):
    """A ``LLAMA_ARG_*`` variable for a flag serve refuses, or with a value llama.cpp would refuse."""


def _truth(text: str) -> Optional[bool]:
    t = text.strip().lower()
    return True if t in TRUTHY else False if t in FALSEY else None


def env_arguments(known: Iterable[str], environ=None, argv: Iterable[str] = ()) -> List[str]:
    """The command-line arguments llama-server's ``LLAMA_ARG_*`` variables stand for, for a parser
    that knows the spellings ``known`` (the caller puts them before its command line, which then
    wins, as in llama-server). A variable of a flag this command does not know is left alone (e.g.
    the server's variables for ``generate``); one of a flag serve refuses is an :class:`EnvError`
    naming both, as is a switch's value that is neither truthy nor falsey. A variable with a name of
    its own (``HF_TOKEN``, ``MTMD_BACKEND_DEVICE``) is only read for a flag serve takes. A variable
    overwritten by a flag of ``argv`` is said on stderr, as llama-server says it."""
    env = os.environ if environ is None else environ
    known, given = set(known), set(argv)
    out: List[str] = []
    for flag in TABLE:
        if not flag.env or flag.names[0] not in known:
            continue
        negative = flag.neg and flag.env.startswith("LLAMA_ARG_") and \
            env.get(flag.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)) is not None
        value = "0" if negative else env.get(flag.env)
        if value is None:
            continue
        name = flag.env if not negative else flag.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
        if flag.value:
            tokens = [flag.names[0], value]
        else:
            truth = _truth(value)
            if truth is None:
                raise EnvError(f"environment variable {name}={value!r}: {flag.names[0]} takes a truthy or falsey "
                               f"value ({', '.join(TRUTHY)} / {', '.join(FALSEY)})")
            if not truth and not flag.neg:
                continue  # a switch turned off: as llama-server, nothing
            tokens = [flag.names[0] if truth else flag.neg[0]]
        why = refusal(tokens[0])
        if why is not None:
            if not flag.env.startswith("LLAMA_"):
                continue  # a generic variable (HF_TOKEN, ...) is not a request for the flag
            shown = flag.long if tokens[0] in flag.names else tokens[0]
            raise EnvError(f"environment variable {name} ({shown}): {why}")
        if given & set(flag.spellings):
            print(f"warn: {name} environment variable is set, but will be overwritten by command line "
                  f"argument {sorted(given & set(flag.spellings))[0]}", file=sys.stderr)
        out += tokens
    return out


def markdown() -> str:
    """docs/server-flags.md, generated from :data:`TABLE`."""
    counts = {s: 0 for s in (SAME, VALUES, NOOP, REFUSED, REMOVED)}
    for f in TABLE:
        counts[f.status] += 1
    lines = [
        "# llama-server's flags in `llama-metaws serve`",
        "",
        "Every option of the vendored `llama-server --help` (llama.cpp as llama-cpp-python 0.3.36 vendors it),",
        "one row each, and what `llama-metaws serve` does with it. Generated from",
        "`llama_metaws/cli/server_flags.py` (`python -m llama_metaws.cli.server_flags > docs/server-flags.md`); the",
        "tests check that this file is what the table generates and that the table holds exactly the",
        "vendored llama-server's flags.",
        "",
        "- **same**: taken, meaning what it means to llama-server;",
        "- **values**: taken for the values the note names, refused for others;",
        "- **no effect**: taken, and changes nothing here (the note says why);",
        "- **refused**: an error naming the flag, with the reason and what to do instead;",
        "- **removed**: llama.cpp removed it; refused with llama.cpp's message.",
        "",
        "A flag's `LLAMA_ARG_*` variable (a container's, a compose file's) stands for the flag, as in",
        "llama-server: the command line wins over it, and a variable of a refused flag is an error that",
        "names both. A flag neither llama-server nor serve has is an error naming it.",
        "",
        f"{len(TABLE)} options: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".",
        "",
        "Our own flags (not llama-server's): `--phase-aware-workspace` (accepted; the workspace is on",
        "wherever a draft context exists), `--no-phase-aware-workspace`, `--workspace-mode`,",
        "`--queue-size`, `--max-body-size`, `--no-mmap` (`-lm none`). The workspace mode that reproduces",
        "the `GGML_ASSERT(tensor)` abort, `unsafe-shared`, is reachable only through `llama-metaws-dev repro`.",
        "The old `--checkpoint-every` is refused: `-cms/--checkpoint-min-step` replaced it.",
        "",
        "| llama-server flag | variable | serve | note |",
        "|---|---|---|---|",
    ]

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    for f in TABLE:
        flag = ", ".join(f"`{s}`" for s in f.names) + (f" `{cell(f.value)}`" if f.value else "")
        env = f"`{f.env}`" if f.env else ""
        lines.append(f"| {flag} | {env} | {f.status} | {cell(f.note)} |")
        if f.neg:
            neg = ", ".join(f"`{s}`" for s in f.neg)
            status = f.neg_status or f.status
            lines.append(f"| {neg} | | {status} | {cell(f.neg_note if f.neg_status else '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
