"""The server's routes, one module per API: :mod:`.openai` (OpenAI's chat and completions),
:mod:`.responses` (OpenAI's Responses API), :mod:`.anthropic` (Anthropic's Messages API) and
:mod:`.llama` (llama-server's own) and :mod:`.ui` (the web page at ``/``). Each module's ``routes(serving)`` gives its Starlette routes
on a :class:`~..serving.Serving`; ``DIALECT`` says in whose shape its errors are answered."""

from . import anthropic, llama, openai, responses, ui

GROUPS = (openai, responses, anthropic, llama, ui)
