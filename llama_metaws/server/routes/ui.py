"""The web page at ``/``, as llama-server serves its web UI there: ours is one HTML file of this
package (``server/ui/index.html``: a chat that streams from ``/v1/chat/completions``), also at
``/index.html``, with small answers of ours at the other paths a browser that knew llama-server's
UI asks for (``/manifest.webmanifest``, ``/_app/version.json``). None needs the API key (the page
asks for it and sends it to the API). ``--no-ui`` leaves them out (404), but ``/sw.js`` is always
served, as llama-server does: a service worker that removes itself, so a browser that kept
another UI's worker for this address loads the page again."""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import List

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import OPENAI
from ..serving import Serving

DIALECT = OPENAI

PATHS = ("/", "/index.html", "/sw.js", "/manifest.webmanifest", "/_app/version.json")

_SELF_REMOVING_WORKER = """\
// llama-metaws serves no service worker: this one unregisters itself and reloads its pages
self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (event) => event.waitUntil((async () => {
  await self.registration.unregister();
  for (const name of await caches.keys()) await caches.delete(name);
  for (const client of await self.clients.matchAll({ type: "window" })) client.navigate(client.url);
})()));
"""


@functools.lru_cache(maxsize=1)
def page() -> bytes:
    """The chat page, read from the package."""
    return resources.files("llama_metaws.server").joinpath("ui", "index.html").read_bytes()


def routes(serving: Serving) -> List[Route]:
    no_cache = {"Cache-Control": "no-cache"}

    async def index(request: Request):
        return Response(page(), media_type="text/html; charset=utf-8", headers=no_cache)

    async def service_worker(request: Request):
        return Response(_SELF_REMOVING_WORKER, media_type="application/javascript", headers=no_cache)

    async def manifest(request: Request):
        body = {"name": "llama-metaws", "short_name": "llama-metaws", "start_url": "./", "display": "standalone",
                "icons": []}
        return Response(json.dumps(body), media_type="application/manifest+json", headers=no_cache)

    async def version(request: Request):
        from ... import __version__

        return Response(json.dumps({"version": __version__}), media_type="application/json", headers=no_cache)

    out = [Route("/sw.js", service_worker, methods=["GET"])]
    if serving.ui:
        out += [Route("/", index, methods=["GET"]), Route("/index.html", index, methods=["GET"]),
                Route("/manifest.webmanifest", manifest, methods=["GET"]),
                Route("/_app/version.json", version, methods=["GET"])]
    return out
