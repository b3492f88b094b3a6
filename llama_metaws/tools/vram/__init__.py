"""Memory over time per device: a sampler, the workspace modes' configurations, their table and plot.

``llama-metaws vram`` runs each configuration (split mode x workspace mode) in its own
subprocess, samples memory per device over model load and the requests, and prints the
comparison of the workspace modes: memory per device. What is measured and how exact each figure is: docs/vram.md. The modules, one concern
each:

- ``sources``: the process's RSS, NVIDIA GPUs through pynvml;
- ``probe``: ggml's accounting of watched contexts, read right after each ``llama_decode``;
- ``sampler``: :class:`Sampler`, the background thread, phases, :class:`Report`;
- ``harness``: the configurations, the child process that runs one, the parent's records;
- ``report``: the table and the plot;
- ``hostkv``: the second table, host-resident KV under tensor split (``--host-kv``);
- ``command``: ``llama-metaws vram``'s flags and run.
"""

from __future__ import annotations

from .command import add_arguments, main, run_from_args
from .harness import (DEFAULT_CONFIGURATIONS, DEFAULT_DEVICES, DEFAULT_PROMPT, Configuration, as_expected,
                      find_configuration, run_configuration, run_configurations)
from .hostkv import format_host_kv, run_host_kv
from .report import format_table, plot
from .sampler import DEFAULT_INTERVAL, Report, Sampler
from .sources import MissingExtraError, NvmlSource, SamplerError, read_rss

__all__ = [
    "Configuration",
    "DEFAULT_CONFIGURATIONS",
    "DEFAULT_DEVICES",
    "DEFAULT_INTERVAL",
    "DEFAULT_PROMPT",
    "MissingExtraError",
    "NvmlSource",
    "Report",
    "Sampler",
    "SamplerError",
    "add_arguments",
    "as_expected",
    "find_configuration",
    "format_host_kv",
    "format_table",
    "main",
    "plot",
    "read_rss",
    "run_configuration",
    "run_configurations",
    "run_from_args",
    "run_host_kv",
]
