"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``, served by the
chat route through :mod:`..anthropic_api`; errors in Anthropic's shape."""

from __future__ import annotations

from typing import List

from starlette.requests import Request
from starlette.routing import Route

from .. import anthropic_api, openai_api
from .. import validation as _validation
from ..errors import ANTHROPIC
from ..serving import JSON, Serving

DIALECT = ANTHROPIC


def routes(serving: Serving) -> List[Route]:
    model = serving.model

    async def messages(request: Request):
        body = await serving.body_of(request)
        plan = await serving.check(_validation.chat, anthropic_api.to_chat(body), model)
        return await serving.run(request, plan, anthropic_api.Responder(openai_api.Responder(plan), body, model))

    async def count_tokens(request: Request):
        body = await serving.body_of(request)
        return JSON(await serving.check(anthropic_api.count_tokens, body, model, _validation.chat))

    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
