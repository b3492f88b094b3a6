"""OpenAI's routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (also
``/chat/completions``), ``GET /v1/models`` (also ``/models``), and llama-server's token count
beside them, ``POST /v1/chat/completions/input_tokens`` (also ``/chat/completions/input_tokens``)."""

from __future__ import annotations

from typing import List

from starlette.requests import Request
from starlette.routing import Route

from .. import openai_api
from .. import validation as _validation
from ..errors import OPENAI
from ..serving import JSON, Serving

DIALECT = OPENAI


def routes(serving: Serving) -> List[Route]:
    model = serving.model

    async def completions(request: Request):
        plan = await serving.check(_validation.completion, await serving.body_of(request), model)
        return await serving.run(request, plan, openai_api.Responder(plan))

    async def chat_completions(request: Request):
        plan = await serving.check(_validation.chat, await serving.body_of(request), model)
        return await serving.run(request, plan, openai_api.Responder(plan))

    async def chat_input_tokens(request: Request):
        return JSON(await serving.check(_validation.chat_input_tokens, await serving.body_of(request), model))

    async def models(request: Request):
        serving.authorize(request)
        return JSON({"object": "list", "data": [
            {"id": model.alias, "aliases": model.aliases, "tags": model.tags, "object": "model",
             "created": serving.created, "owned_by": "llama-metaws",
             "meta": {"n_vocab": model.n_vocab, "n_ctx": model.n_ctx}}]})

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
        Route("/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
    ]
