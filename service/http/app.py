"""The HTTP side of a registry (`serve --http`): `/metrics` and a read-only web view of the history.

Starlette: a small, well-kept ASGI toolkit whose routing, requests, responses and
Jinja2 templates are all this needs. Pages are rendered on the server from
templates/ (no JavaScript, no build step); they read through the use case's read
methods (service/http/views.py), which run on Starlette's worker threads since
the store blocks.

Authentication, when the registry has tokens (service/auth.py): the web view
needs a reader's or an admin's token, given as `Authorization: Bearer TOKEN`
(scripts, curl) or, for a browser, through the login form, which keeps it in an
HttpOnly, SameSite=Strict cookie (Secure under TLS); a browser cannot add a
header to a link it follows, and a cookie the page's scripts cannot read is the
usual way to carry a credential between server-rendered pages. `/metrics` stays
open, as Prometheus scrapes expect: it holds counts and timings, no plan.
"""

from __future__ import annotations

import datetime as dt
import pathlib
from typing import Callable
from urllib.parse import parse_qs, quote, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from loadplan.client.auth import AUTHORIZATION_KEY
from loadplan.errors import InvalidArgument, NotFound, RegistryError
from ..auth import ADMIN, READER, TokenStore
from ..metrics import CONTENT_TYPE_LATEST, RegistryMetrics
from ...plan import ENGINE_LOADPLAN
from ..registry import Registry
from ..rules.engines import ENGINES
from . import views

TOKEN_COOKIE = "loadplan_token"
VIEW_ROLES = frozenset({READER, ADMIN})
TEMPLATES = pathlib.Path(__file__).with_name("templates")


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["value"] = views.value_text
    env.filters["when"] = lambda t: t.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if t else "—"
    env.filters["rank"] = views.rank_text
    env.filters["q"] = lambda s: quote(str(s), safe="")
    return env


def _time_param(request: Request, name: str) -> dt.datetime | None:
    text = request.query_params.get(name, "").strip()
    if not text:
        return None
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidArgument(name, f"{text!r} is not a time (e.g. 2026-11-29T10:00)") from None
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)   # naive: UTC, as the CLI


def create_app(registry: Registry, metrics: RegistryMetrics | None = None, tokens: TokenStore | None = None,
               secure_cookie: bool = False) -> Starlette:
    """The ASGI app of one registry: its read methods, its metrics, its tokens (None: open)."""
    env = _environment()

    def page(request: Request, template: str, status: int = 200, **context) -> HTMLResponse:
        html = env.get_template(template).render(request=request, auth=bool(tokens), **context)
        return HTMLResponse(html, status_code=status)

    def guarded(view: Callable[[Request], Response]) -> Callable[[Request], Response]:
        def run(request: Request) -> Response:
            if tokens:
                role = _role(request, tokens)
                if role not in VIEW_ROLES:
                    return _refuse(request, role)
            try:
                return view(request)
            except NotFound as e:
                return page(request, "error.html", 404, title="Not found", message=e.message)
            except InvalidArgument as e:
                return page(request, "error.html", 400, title="Bad request", message=e.message)
            except RegistryError as e:
                return page(request, "error.html", 503, title="Unavailable", message=e.message)
        return run

    def _refuse(request: Request, role: str | None) -> Response:
        if role is not None:     # a worker's token: known, but not one that may read the history
            return page(request, "error.html", 403, title="Forbidden",
                        message=f"a {role} token may not read the history; use a reader's or an admin's")
        if "text/html" in request.headers.get("accept", ""):
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"/login?{urlencode({'next': target})}", status_code=303)
        return PlainTextResponse("a reader's bearer token is required\n", status_code=401,
                                 headers={"WWW-Authenticate": 'Bearer realm="loadplan"'})

    @guarded
    def deployment_list(request: Request) -> Response:
        model = request.query_params.get("model", "")
        after, before = _time_param(request, "after"), _time_param(request, "before")
        listing = views.deployments(registry, model, after, before)
        return page(request, "deployments.html", listing=listing, model=model,
                    after=request.query_params.get("after", ""), before=request.query_params.get("before", ""))

    @guarded
    def deployment_page(request: Request) -> Response:
        d = views.deployment(registry, request.path_params["deployment_id"])
        if not d.groups:
            raise NotFound(f"deployment {d.deployment_id!r} has no plans", field="deployment_id")
        return page(request, "deployment.html", d=d)

    @guarded
    def plan_page(request: Request) -> Response:
        plan = registry.get_plan(request.path_params["plan_id"], include_history=True)
        target = views.draft_target(registry, plan)
        return page(request, "plan.html", plan=plan, inputs=views.inputs(plan), target=target,
                    decisions=sorted(plan.decisions.values(), key=lambda d: d.key),
                    rebalances=len(views.rebalances(plan)) > 1)

    @guarded
    def eplb_page(request: Request) -> Response:
        plan = registry.get_plan(request.path_params["plan_id"], include_history=True)
        return page(request, "eplb.html", plan=plan, rebalances=views.rebalances(plan))

    @guarded
    def diff_page(request: Request) -> Response:
        a, b = request.query_params.get("a", "").strip(), request.query_params.get("b", "").strip()
        diff = registry.diff_plans(a, b) if a or b else None
        return page(request, "diff.html", diff=diff, a=a, b=b)

    @guarded
    def upgrade_page(request: Request) -> Response:
        q = request.query_params
        engine, to = q.get("engine", "sglang").strip(), q.get("to", "").strip()
        from_version, deployment = q.get("from", "").strip(), q.get("deployment", "").strip()
        report = registry.upgrade_check(engine, to, from_version, deployment or None) if to else None
        return page(request, "upgrade.html", report=report, engines=[e for e in ENGINES if e != ENGINE_LOADPLAN],
                    engine=engine, to=to, from_version=from_version, deployment=deployment)

    def backends_page(request: Request) -> Response:
        q = request.query_params
        engine, version = q.get("engine", "").strip() or ENGINE_LOADPLAN, q.get("version", "").strip()
        name, release, rows = registry.list_backends(engine, version)
        return page(request, "backends.html", rows=rows, engine=name, version=release, engines=list(ENGINES),
                    releases=ENGINES[name].releases)

    def login_form(request: Request) -> Response:
        return page(request, "login.html", next=_safe_next(request.query_params.get("next", "")), failed=False)

    async def login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        token = form.get("token", [""])[0].strip()
        nxt = _safe_next(form.get("next", [""])[0])
        role = tokens.role_of(token) if tokens and token else None
        if tokens and role not in VIEW_ROLES:
            return page(request, "login.html", 401, next=nxt, failed=True)
        response = RedirectResponse(nxt, status_code=303)
        if tokens:
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict", secure=secure_cookie,
                                path="/")
        return response

    def logout(request: Request) -> Response:
        response = RedirectResponse("/login" if tokens else "/", status_code=303)
        response.delete_cookie(TOKEN_COOKIE, path="/")
        return response

    def metrics_page(request: Request) -> Response:
        if metrics is None:
            return PlainTextResponse("no metrics on this server\n", status_code=404)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[
        Route("/", lambda request: RedirectResponse("/deployments", status_code=303)),
        Route("/deployments", deployment_list),
        Route("/deployments/{deployment_id:path}", deployment_page),
        Route("/plans/{plan_id}", plan_page),
        Route("/plans/{plan_id}/eplb", eplb_page),
        Route("/diff", diff_page),
        Route("/upgrade", upgrade_page),
        Route("/backends", backends_page),
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["GET", "POST"]),
        Route("/metrics", metrics_page),
    ])


def _role(request: Request, tokens: TokenStore) -> str | None:
    header = request.headers.get(AUTHORIZATION_KEY, "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        token = request.cookies.get(TOKEN_COOKIE, "")
    return tokens.role_of(token.strip()) if token.strip() else None


def _safe_next(target: str) -> str:
    """A path on this site to go back to after logging in (never another site's address)."""
    return target if target.startswith("/") and not target.startswith("//") else "/deployments"
