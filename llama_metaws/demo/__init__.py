"""The demo's models, written on the spot with gguf-py (no downloads).

* :mod:`.model`: the tiny ``qwen35`` MTP model ``llama-metaws demo`` and ``vram`` run on when no
  model is given (:func:`~.model.make_tiny_mtp_model`), and the writer it is made with;
* :mod:`.realshape`: the ``qwen35`` MTP model at real proportions (Qwen's vocabulary), the demo's
  real-vocabulary row (:func:`~.realshape.make_mtp_model`);
* :mod:`.agreement`: the design that makes a head's greedy draft equal the target's next token at
  a chosen rate; :mod:`.vocab`, :mod:`.metadata`: the vocabularies and metadata they carry.

The tests build more models on them (the developer package's ``llama_metaws_dev.testing``); the
planner's architecture layouts write their headers with the same writer
(:mod:`llama_metaws.tools.layouts`).
"""
