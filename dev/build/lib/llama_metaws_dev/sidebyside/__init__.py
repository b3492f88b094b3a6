"""The GPU run kit's real-shape step: our configurations and llama-server's, side by side.

``python -m llama_metaws_dev.sidebyside`` (``run.sh``'s ``realshape`` step) writes a qwen35 MTP
model at Qwen3.5/3.6-27B's width, FFN and vocabulary (:func:`llama_metaws.demo.realshape.make_mtp_model`,
as many layers as the budget allows, q8_0) into the kit's work folder, then runs each
configuration in its own process: ours with MTP drafting under tensor split with the alias and
with private meta buffers, ours without drafting, llama-server (built from the same patched tree)
with draft-mtp and without, ours under layer split; the drafting ones at the same synthetic
acceptance (``--spec-synth-len``). Per row: tokens/s, draft acceptance, ggml's compute bytes per
device, NVML's peak per GPU, peak RSS. docs/gpu-kit.md says how to read them next to the seed's
table. The modules, one concern each:

- ``shapes``: the shapes, the layer count the budget allows, the model in the work folder;
- ``server``: one llama-server row (start, requests, memory from outside, compute from its log);
- ``step``: the rows in order within the deadline, the record file rewritten after each;
- ``report``: the table (text and Markdown) and the ratios beside the seed's figures;
- ``command``: the flags.
"""

from __future__ import annotations

from .report import format_markdown, format_text
from .shapes import REAL, SHAPES, SMALL, Costs, Shape, choose_layers, estimated_bytes, write_model
from .step import ROWS, Settings, run_step

__all__ = ["Costs", "REAL", "ROWS", "SHAPES", "SMALL", "Settings", "Shape", "choose_layers", "estimated_bytes",
           "format_markdown", "format_text", "run_step", "write_model"]
