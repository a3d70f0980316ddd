"""The HTTP API as one ASGI app: the protocol adapters' routes behind the call middleware.

Routes: OpenAI's embeddings API (service/openai.py), the Open Inference Protocol's REST API
(service/kserve/rest.py), text-embeddings-inference's embedding and similarity routes (service/tei.py) and the utility
routes (service/utility.py), over the same data plane as the gRPC adapters. The OpenAPI document is at
/openapi.json, with interactive docs at /docs and /redoc. Every error goes through the one error map
(http/errors.py renders it in each API's shape).
"""

from __future__ import annotations

import functools
import logging

from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path
from starlette.types import Scope

from mhaserve.runtime.errors import NotFound, ServiceError, Unimplemented
from mhaserve.service import openai, tei, utility
from mhaserve.service.auth import Keys
from mhaserve.service.context import request_id
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.http.errors import TEI_UNSERVED, render
from mhaserve.service.http.middleware import CallMiddleware, FastRoute, loggable
from mhaserve.service.http.openapi import complete
from mhaserve.service.incoming import Incoming
from mhaserve.service.inflight import InFlight
from mhaserve.service.kserve import rest as kserve_rest
from mhaserve.service.metrics import Metrics
from mhaserve.service.models import ModelManager
from mhaserve.service.version import server_version

log = logging.getLogger(__name__)

DOCS_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
# Open to a GET (and HEAD) without an API key: health probes and the API's own description (as health and
# reflection on gRPC). `/` among them, where TEI answers a GET as health and cloud load balancers probe by
# default; a POST there embeds, and needs a key.
OPEN_GETS = (*utility.HEALTH_PATHS, *kserve_rest.HEALTH_PATHS, *DOCS_PATHS)


def always_answered(method: str, path: str) -> bool:
    """Routes that answer while the model loads and while the server drains: health (saying so), docs, and
    KServe's server metadata (it describes the server, not the models; Triton answers it in every state)."""
    if method in ("GET", "HEAD") and path in OPEN_GETS:
        return True
    return path == "/v2" or (path.startswith("/v2/models/") and path.endswith("/ready"))


def build(
    dataplane: DataPlane,
    *,
    metrics: Metrics,
    in_flight: InFlight,
    keys: Keys,
    max_body_bytes: int,
    read_timeout: float,
    manager: ModelManager,
    incoming: Incoming | None = None,
) -> CallMiddleware:
    app = FastAPI(
        title="mhaserve",
        version=server_version(),
        summary="Transformer encoder embeddings: OpenAI's embeddings API, the Open Inference Protocol, utilities.",
        # A path with a trailing slash is not found, not redirected: Starlette's redirect names the scheme and
        # host it was reached by (http, behind a proxy that ends TLS), and was counted as an answered request.
        redirect_slashes=False,
        openapi_url="/openapi.json",
        docs_url="/docs",
        redoc_url="/redoc",
    )
    app.include_router(openai.router(dataplane))
    app.include_router(kserve_rest.router(dataplane, manager))
    app.include_router(tei.router(dataplane))
    app.include_router(utility.router(dataplane, max_message_bytes=max_body_bytes))
    complete(app, keys=keys.enabled, open_gets=OPEN_GETS)

    def respond(request: Request, error: BaseException, extra: dict[str, str] | None = None) -> Response:
        status, headers, body = render(error, request.url.path, request_id.get(), request.scope)
        return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers} | (extra or {}))

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> Response:
        return respond(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def router_error(request: Request, error: StarletteHTTPException) -> Response:
        if error.status_code == 404:
            path = request.url.path
            plain = path.rstrip("/")
            hint = f" (without the trailing slash: {plain})" if plain and path.endswith("/") else ""
            if path in TEI_UNSERVED:
                hint = (
                    f": text-embeddings-inference serves it {TEI_UNSERVED[path]}; this server serves embedding models "
                    "(POST /embed, /similarity, /v1/embeddings)"
                )
            elif plain == "/metrics":  # where TEI serves them: a scrape set up for it read a bare "no route"
                hint = ": the metrics are served on their own port (--metrics-port), not the API's"
            return respond(request, NotFound(f"no route {request.method} {path}{hint}"))
        # 405: a route without this method. The router's Allow header names the methods of the first route it
        # found for the path; `/` has two (GET is health, POST embeds), so the header is made from them all.
        methods = routes.methods_of(request.url.path)
        allow = {"allow": ", ".join(methods)} if methods else dict(error.headers or {})
        return respond(request, Unimplemented(f"{request.method} is not allowed on {request.url.path}"), allow)

    @app.exception_handler(Exception)
    async def bug(request: Request, error: Exception) -> Response:
        log.error("%s %s failed", request.method, loggable(request.url.path), exc_info=error)
        return respond(request, error)

    routes = _Routes(app)
    embed = functools.partial(openai.embed, dataplane)
    tei_routes = {
        tei.EMBED_PATH: tei.embed,
        tei.SIMILARITY_PATH: tei.similarity,
        tei.ROOT_PATHS[0]: tei.root,
        tei.ROOT_PATHS[1]: tei.invocations,
    }
    return CallMiddleware(
        app,
        metrics=metrics,
        in_flight=in_flight,
        gate=dataplane.admission,
        control_gate=functools.partial(dataplane.admission, control=True),
        hold=dataplane.hold,
        keys=keys,
        max_body_bytes=max_body_bytes,
        read_timeout=read_timeout,
        incoming=incoming,
        open_gets=OPEN_GETS,
        always_answered=always_answered,
        admin_prefix=kserve_rest.REPOSITORY_PREFIX,
        fast_routes={
            **{("POST", path): FastRoute(path, embed) for path in openai.EMBEDDINGS_PATHS},
            **{("POST", path): FastRoute(path, functools.partial(run, dataplane)) for path, run in tei_routes.items()},
        },
        route_of=routes.route_of,
    )


class _Routes:
    """The API's routes, from its own description, in the order the router tries them (FastAPI's included
    routers do not expose their routes for matching)."""

    def __init__(self, app: FastAPI) -> None:
        self.templates = [
            (template, compile_path(template)[0], {method.upper() for method in operations})
            for template, operations in app.openapi().get("paths", {}).items()
        ]

    def route_of(self, scope: Scope) -> str | None:
        """The template of the route a request's method and path reach (`/v2/models/{model_name}/infer`)."""
        for template, pattern, methods in self.templates:
            if scope["method"] in methods and pattern.match(scope["path"]):
                return template
        return None

    def methods_of(self, path: str) -> list[str]:
        """Every method some route takes at `path` (HEAD wherever GET is), as an Allow header lists them."""
        methods = set().union(*(m for _, pattern, m in self.templates if pattern.match(path)))
        return sorted(methods | ({"HEAD"} if "GET" in methods else set()))
