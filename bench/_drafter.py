"""The engine ``Llama`` runs, over a bench's own low-level contexts (bench_workspace,
bench_tensor_split)."""

from __future__ import annotations

from llama_metaws.engine.core import Engine


class Drafter(Engine):
    """``generate`` is one fresh greedy request; ``on_step`` is called on the engine's thread after
    each of its steps."""

    def generate(self, prompt, n, on_step=None):
        self.after_step = on_step
        try:
            return self.complete(prompt, n, stop_at_eog=False, cache_prompt=False)
        finally:
            self.after_step = None
