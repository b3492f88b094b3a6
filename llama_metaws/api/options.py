"""``LlamaOptions``: what :class:`~llama_metaws.Llama` takes beyond ``llama_cpp.Llama``'s arguments.

One object, checked when it is made (a ``ValueError`` that names the argument, before anything
loads); ``Llama.__init__`` builds one from its keyword arguments (or takes one, ``options=``) and
loads from it. What each field does: the module docstring of :mod:`llama_metaws.api.llama` and
docs/python-api.md. The binding's own arguments that we read with wider values (``n_gpu_layers``
``"auto"``, ``flash_attn="auto"``, a ``draft_model`` path, ``split_mode`` names) stay the
binding's keywords; ``split_mode`` and ``tensor_split`` are here because ``Llama`` names them in
its signature.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Union

from ..engine import checkpoints as _ckpt
from ..engine import fit as _fit
from ..engine.contexts import MODEL_FIELD_KWARGS, split_mode_value
from ..engine.drafting import AdaptiveLength
from ..engine.workspace import MODES as WORKSPACE_MODES
from ..native.binding import llama_cpp

__all__ = ["DRAFT_KINDS", "LlamaOptions"]

DRAFT_KINDS = ("mtp",)


def _count(value, at_least: int) -> bool:
    """An ``int`` (not a ``bool``) of at least ``at_least``."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= at_least


@dataclasses.dataclass
class LlamaOptions:
    """Our keyword arguments of ``Llama`` (llama.cpp's option names), checked at construction."""

    # drafting
    draft: Optional[str] = None
    draft_max: Union[int, str] = 3
    draft_p_min: float = 0.0
    draft_synth_rates: Optional[Sequence[float]] = None
    draft_synth_len: Optional[float] = None
    # generation past a full context
    context_shift: bool = False
    # placement
    devices: Optional[Sequence[str]] = None
    rpc_servers: Union[None, str, Sequence[str]] = None
    split_mode: Union[str, int] = llama_cpp.LLAMA_SPLIT_MODE_LAYER
    tensor_split: Optional[List[float]] = None
    # the phase-aware workspace
    phase_aware_workspace: bool = True
    workspace_mode: str = "alias"
    allow_unsafe_workspace: bool = False
    # slots and prompt reuse
    n_seq_max: int = 1
    kv_unified: bool = False
    ctx_checkpoints: int = _ckpt.DEFAULT_CTX_CHECKPOINTS
    checkpoint_min_step: int = _ckpt.DEFAULT_CHECKPOINT_MIN_STEP
    ctx_checkpoints_bytes: int = _ckpt.DEFAULT_CHECKPOINT_BYTES
    # chat
    chat_template: Optional[str] = None
    # llama.cpp's fit of layers and context to the devices' memory
    fit_params: Optional[bool] = None
    fit_target_mib: Union[int, Sequence[int]] = _fit.FIT_TARGET_MIB
    fit_min_ctx: int = _fit.FIT_MIN_CTX
    # llama_model_params fields by llama.cpp's names (None: llama.cpp's default)
    load_mode: Optional[int] = None
    lazy_mode: Optional[int] = None
    check_tensors: Optional[bool] = None
    use_extra_bufts: Optional[bool] = None
    no_host: Optional[bool] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """A ``ValueError`` naming the first argument that cannot be used."""
        if self.draft is not None and self.draft not in DRAFT_KINDS:
            raise ValueError(f"draft={self.draft!r}: the supported kinds are {DRAFT_KINDS} (or None)")
        if not self.adaptive and not _count(self.draft_max, 1):
            raise ValueError(f"draft_max must be an integer >= 1 or 'auto', got {self.draft_max!r}")
        if not (0.0 <= float(self.draft_p_min) <= 1.0):
            raise ValueError(f"draft_p_min must be in [0, 1], got {self.draft_p_min!r}")
        if self.workspace_mode not in WORKSPACE_MODES:
            raise ValueError(f"workspace_mode {self.workspace_mode!r} is not one of {', '.join(WORKSPACE_MODES)}")
        if self.workspace_mode == "unsafe-shared" and not self.allow_unsafe_workspace:
            raise ValueError("workspace_mode='unsafe-shared' aborts the process under tensor split; "
                             "pass allow_unsafe_workspace=True to reproduce that, or use 'alias'")
        split_mode_value(self.split_mode)
        if not _count(self.n_seq_max, 1):
            raise ValueError(f"n_seq_max must be an integer >= 1, got {self.n_seq_max!r}")
        for name in ("ctx_checkpoints", "ctx_checkpoints_bytes"):
            if not _count(getattr(self, name), 0):
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not _count(self.checkpoint_min_step, 0):
            raise ValueError(f"checkpoint_min_step must be an integer >= 0 (0: no minimum), "
                             f"got {self.checkpoint_min_step!r}")

    @property
    def adaptive(self) -> bool:
        """``draft_max="auto"``: the length adapts per step (:class:`~.engine.drafting.AdaptiveLength`)."""
        return self.draft_max == "auto"

    @property
    def draft_max_cap(self) -> int:
        """The longest draft asked for: ``draft_max``, or for ``"auto"`` the policy's cap."""
        return AdaptiveLength.CAP if self.adaptive else self.draft_max

    @property
    def split(self) -> int:
        """``split_mode`` as llama.cpp's constant."""
        return split_mode_value(self.split_mode)

    def model_fields(self) -> dict:
        """The ``llama_model_params`` fields given by name (``load_mode``, ...)."""
        return {name: getattr(self, name) for name in MODEL_FIELD_KWARGS if getattr(self, name) is not None}
