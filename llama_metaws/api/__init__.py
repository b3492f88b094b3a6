"""The user's Python API: :class:`~.llama.Llama`, the drop-in ``llama_cpp.Llama`` on the batched engine.

* :mod:`.llama`: ``Llama`` itself, its contexts, its engine, its reports;
* :mod:`.options`: :class:`~.options.LlamaOptions`, every keyword of ours, checked in one place;
* :mod:`.completion`: ``create_completion``'s answers in the binding's shapes, over engine requests;
* :mod:`.chat_layer`: llama.cpp's own chat layer (``common/chat``) through the shim;
* :mod:`.state`: ``save_state`` / ``load_state`` with the draft context.

``from llama_metaws import Llama`` is the way in (importing this package loads nothing).
"""
