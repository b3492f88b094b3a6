"""What the vendored llama.cpp can do per architecture, for refusals before a model loads.

Read from the vendored tree (``tests/test_families.py`` keeps these lists equal to it):

* :data:`MTP_GRAPH_ARCHS`: the architectures whose ``build_arch_graph`` builds a ``graph_mtp`` for
  an MTP context (``src/models/*.cpp``). Others may load NextN layers (nemotron_h, glm4, exaone4,
  ...) but an MTP context on them runs the trunk's graph and its first decode fails, or throws
  (glm5-next's is a TODO).
* :data:`NO_TENSOR_SPLIT_ARCHS`: ``llm_arch_supports_sm_tensor`` (``src/llama-arch.cpp``) says
  false: loading one under ``LLAMA_SPLIT_MODE_TENSOR`` fails ("LLAMA_SPLIT_MODE_TENSOR not
  implemented for architecture").
"""

from __future__ import annotations

__all__ = ["MTP_GRAPH_ARCHS", "NO_TENSOR_SPLIT_ARCHS", "check_mtp_graph", "check_tensor_split"]

MTP_GRAPH_ARCHS = frozenset({
    "bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4", "glm-dsa", "glm4moe",
    "hy_v3", "mimo2", "nemotron_h_moe", "qwen35", "qwen35moe", "qwen3next", "step35",
})

NO_TENSOR_SPLIT_ARCHS = frozenset({
    "bailingmoe3", "bitnet", "deepseek2", "deepseek32", "dots3note", "falcon-h1", "gemma3n",
    "glm-dsa", "glm5-next", "granitehybrid", "grok", "hy_v4", "jamba", "kimi-k3", "kimi-linear",
    "mamba", "mamba2", "minicpm3", "minimax-01", "minimax-m2", "minimax-m3", "mistral4", "mpt",
    "nemotron_h", "nemotron_h_moe", "olmo2", "olmoe", "plamo2", "qwen3tts", "qwen4exp", "t5",
})


def check_mtp_graph(arch: str) -> None:
    """ValueError unless llama.cpp drafts for ``arch`` with an MTP context."""
    if arch not in MTP_GRAPH_ARCHS:
        raise ValueError(
            f"draft='mtp': llama.cpp has no MTP graph for architecture {arch!r} (its NextN layers "
            f"load, but an MTP context cannot decode with them). Architectures with one: "
            f"{', '.join(sorted(MTP_GRAPH_ARCHS))}. Use draft=None")


def check_tensor_split(arch: str) -> None:
    """ValueError when llama.cpp has no tensor split for ``arch``."""
    if arch in NO_TENSOR_SPLIT_ARCHS:
        raise ValueError(
            f"split_mode='tensor': llama.cpp has no tensor split for architecture {arch!r} "
            f"(LLAMA_SPLIT_MODE_TENSOR not implemented). Use split_mode='layer' (layers over the "
            f"devices) or 'none' (one device)")
