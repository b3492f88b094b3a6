"""OpenAI's Responses API: ``POST /v1/responses`` (also ``/responses``), served by the chat route
through :mod:`..responses_api`."""

from __future__ import annotations

from typing import List

from starlette.requests import Request
from starlette.routing import Route

from .. import openai_api
from .. import validation as _validation
from .. import responses_api
from ..errors import OPENAI
from ..serving import Serving

DIALECT = OPENAI


def routes(serving: Serving) -> List[Route]:
    model = serving.model

    async def responses(request: Request):
        body = await serving.body_of(request)
        chat = responses_api.to_chat(body)
        plan = await serving.check(_validation.chat, chat, model)
        responder = responses_api.Responder.responder(plan, openai_api.Responder(plan), body, model.alias)
        return await serving.run(request, plan, responder)

    return [
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/responses", responses, methods=["POST"]),
    ]
