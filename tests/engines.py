"""Engines over low-level contexts, for the tests that drive the workspace, faults and pressure.

:class:`Greedy` is the engine that ``Llama`` and ``serve`` run, with ``generate(prompt, n)``:
``n`` greedy tokens of a fresh request (the whole prompt evaluated again), on slot 0 by default.
"""

from llama_metaws.engine.core import Engine


class Greedy(Engine):
    """An :class:`~llama_metaws.engine.core.Engine`; ``generate`` answers one greedy request."""

    def generate(self, prompt, n, *, reuse=False):
        return self.complete(list(prompt), n, stop_at_eog=False, cache_prompt=reuse)



def generate(target, draft, prompt, n, draft_max=3, **kw):
    """One fresh greedy request on an engine made for it."""
    with Greedy(target, draft, draft_max=draft_max, **kw) as e:
        return e.generate(prompt, n)
