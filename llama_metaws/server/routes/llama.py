"""llama-server's own routes (:mod:`..llama_api` answers them): ``POST /completion`` (and
``/completions``, as llama-server routes it; a list of prompts answered as a list), ``/tokenize``, ``/detokenize``,
``/apply-template``, ``/infill`` (:mod:`..infill`), ``GET /props``, ``GET /slots`` and
``POST /slots/{id}`` (:mod:`..slot_actions`), ``GET /health`` (also ``/v1/health``),
``GET /metrics`` (with ``--metrics``)."""

from __future__ import annotations

import asyncio
from typing import List

from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from .. import infill as _infill
from .. import llama_api
from .. import slot_actions as _slot_actions
from .. import metrics as _metrics
from ..errors import LLAMA, RequestError, unavailable
from ..serving import JSON, Serving

DIALECT = LLAMA


def routes(serving: Serving) -> List[Route]:
    worker, model = serving.worker, serving.model

    async def completion(request: Request, check=llama_api.completion):
        checked = await serving.check(check, await serving.body_of(request), model)  # one per prompt
        responders = [llama_api.Responder(plan, options, model) for plan, options in checked]
        if checked[0][1].n_predict_zero:
            answers = [responder.zero() for responder in responders]
            return JSON(answers[0] if len(answers) == 1 else answers)
        return await serving.run_all(request, [plan for plan, _ in checked], responders)

    async def infill(request: Request):
        return await completion(request, _infill.infill)

    def checked(fn):
        """A route answered by ``fn(body, model)``, run off the event loop."""
        async def route(request: Request):
            return JSON(await serving.check(fn, await serving.body_of(request), model))
        return route

    async def health(request: Request):
        if worker.unavailable is not None:
            raise unavailable(worker.unavailable)
        return JSON({"status": "ok"})

    async def props(request: Request):
        serving.authorize(request)
        return JSON(llama_api.props(model, total_slots=worker.n_parallel, slots_endpoint=serving.slots,
                                    metrics=serving.metrics, model_path=serving.model_path,
                                    build_info=serving.build_info))

    async def slots(request: Request):
        serving.authorize(request)
        if not serving.slots:
            raise RequestError(501, "This server does not support slots endpoint. Start it with `--slots`",
                               type="not_supported_error", code="slots_disabled")
        states = [dict(s, n_ctx=model.n_ctx) for s in worker.slots()]
        if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in states):
            raise RequestError(503, "no slot available", type="server_error", code="no_slot_available")
        return JSON(states)

    async def slot_action(request: Request):
        serving.authorize(request)
        wants_file = serving.slot_save_path and request.query_params.get("action") in ("save", "restore")
        body = await serving.body_of(request) if wants_file else {}  # erase takes no body
        return JSON(await asyncio.to_thread(_slot_actions.slot_action, worker.llm, serving.slot_save_path,
                                            request.path_params["id_slot"], request.query_params.get("action"),
                                            body))

    async def metrics(request: Request):
        serving.authorize(request)
        if not serving.metrics:
            raise RequestError(501, "this server does not serve metrics: start it with --metrics",
                               type="not_supported_error", code="metrics_disabled")
        res = PlainTextResponse(_metrics.render(worker), media_type="text/plain; version=0.0.4")
        # with llama-server's capitals: Starlette's headers argument would lower them
        res.raw_headers.append((b"Process-Start-Time-Unix", str(serving.created).encode()))
        return res

    return [
        Route("/completion", completion, methods=["POST"]),
        Route("/completions", completion, methods=["POST"]),
        Route("/infill", infill, methods=["POST"]),
        Route("/tokenize", checked(llama_api.tokenize), methods=["POST"]),
        Route("/detokenize", checked(llama_api.detokenize), methods=["POST"]),
        Route("/apply-template", checked(llama_api.apply_template), methods=["POST"]),
        Route("/props", props, methods=["GET"]),
        Route("/slots", slots, methods=["GET"]),
        Route("/slots/{id_slot}", slot_action, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
