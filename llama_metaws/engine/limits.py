"""What the contexts are sized for: the longest draft, the output rows each context reserves.

Pure Python (no native import), so the command line can read it before anything loads.
"""

from __future__ import annotations

#: draft_max="auto": the longest draft the adaptive length may reach (the contexts are sized for it)
AUTO_DRAFT_MAX = 6

__all__ = ["AUTO_DRAFT_MAX"]
