"""The server's routes, one module per API: :mod:`.openai` (OpenAI's) and :mod:`.llama`
(llama-server's own). Each module's ``routes(serving)`` gives its Starlette routes on a
:class:`~..serving.Serving`; ``DIALECT`` says in whose shape its errors are answered."""

from . import llama, openai

GROUPS = (openai, llama)
