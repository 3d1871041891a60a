"""The console's web application (DESIGN §7.5): pages that read a store, forms that act
through `statemachine.operator`.

Every page reads the store when it is asked for, so what it shows is never older than
the request; every form carries what its page showed (the run's version, and for an
approval the call's fingerprint), and the operator refuses the write when the run moved
since (`ConcurrencyConflict`) or the fingerprint is not the call's: a person decides on
what is there, or on nothing. A refusal shows the typed error on the run's page, read
again, and has changed nothing.

Reads go through a read-only store; writes through a second, writable one (none at all
with ``read_only``, whose application has no write route). The application runs no
script in the browser and works without JavaScript; its pages forbid every script and
frame (Content-Security-Policy) and escape every value they show.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import attrs
import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from statemachine import operator
from statemachine.cli.common import chosen_steps, shown
from statemachine.codec import parse
from statemachine.console import views
from statemachine.console.auth import COOKIE, LOGIN_SECONDS, MAX_NAME, Login, Logins, csrf_matches
from statemachine.errors import ControlError, RunNotFound
from statemachine.values import Resolution

HERE = Path(__file__).parent
MAX_FORM = 1_048_576
"""The largest form body a write accepts (bytes)."""
POLICY = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
          "frame-ancestors 'none'; base-uri 'none'")
DONE = {"approve": "Approved.", "reject": "Rejected.", "resolve": "Resolved.",
        "abandon": "Abandoned.", "login": "Logged in.", "logout": "Logged out."}
"""The only texts a redirect's ``done=`` may make a page say."""

Handler = Callable[[Request], Awaitable[Response]]


class Refused(Exception):
    """A write the console refuses before asking the operator (status, one line)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@attrs.frozen
class Console:
    """What one console serves: the stores it reads and writes, its logins."""

    reads: Any
    writes: Any | None
    """None: a read-only console."""
    logins: Logins | None
    """None: no login (a read-only console without a token)."""
    private: bool
    """Reading needs a login too (the console was given a token file)."""
    hosts: frozenset[str] | None
    """The ``Host`` headers it answers (loopback names: DNS rebinding), or None: any."""
    clock: Callable[[], int] = views.now_micros


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["q"] = lambda value: quote(str(value), safe="")
    return env


def create_app(console: Console) -> Starlette:
    """The application serving ``console``."""
    env = _environment()

    def login_of(request: Request) -> Login | None:
        if console.logins is None:
            return None
        return console.logins.find(request.cookies.get(COOKIE))

    def page(request: Request, template: str, status: int = 200, **values: Any) -> Response:
        login = login_of(request)
        html = env.get_template(template).render(
            login=login, writable=console.writes is not None,
            can_login=console.logins is not None, path=request.url.path,
            done=DONE.get(request.query_params.get("done", "")), **values)
        return HTMLResponse(html, status_code=status)

    def guarded(handler: Handler, *, reading: bool = True) -> Handler:
        async def wrapped(request: Request) -> Response:
            host = request.headers.get("host", "")
            if console.hosts is not None and host.lower() not in console.hosts:
                return HTMLResponse("unknown host", status_code=421)
            if reading and console.private and login_of(request) is None:
                target = request.url.path + (f"?{request.url.query}" if request.url.query
                                             else "")
                return RedirectResponse(f"/login?next={quote(target, safe='')}", 303)
            response = await handler(request)
            response.headers["Content-Security-Policy"] = POLICY
            response.headers["X-Content-Type-Options"] = "nosniff"
            response.headers["Referrer-Policy"] = "same-origin"  # no-referrer: Origin null
            response.headers["Cache-Control"] = "no-store"
            return response

        return wrapped

    async def home(request: Request) -> Response:
        return RedirectResponse("/runs", 303)

    async def runs(request: Request) -> Response:
        try:
            steps = chosen_steps(request.query_params.getlist("step") or None)
        except Exception as error:  # UserError: an unknown step
            return page(request, "error.html", 400, title="Runs", message=str(error))
        blocked = request.query_params.get("blocked") in ("1", "on", "true")
        found = await run_in_threadpool(views.runs_page, console.reads, steps=steps,
                                        blocked=blocked, now=console.clock())
        return page(request, "runs.html", runs=found, title="Runs")

    async def inbox(request: Request) -> Response:
        found = await run_in_threadpool(views.inbox_page, console.reads, now=console.clock())
        return page(request, "inbox.html", entries=found, title="Inbox")

    async def show_run(request: Request, status: int = 200,
                       error: tuple[str, str] | None = None,
                       run_id: str | None = None) -> Response:
        run_id = request.query_params.get("id", "") if run_id is None else run_id
        try:
            found = await run_in_threadpool(views.run_page, console.reads, run_id)
        except RunNotFound:
            return page(request, "error.html", 404, title="No such run",
                        message=f"no run {shown(run_id)!r} in this store")
        return page(request, "run.html", status, run=found, title=f"Run {run_id}",
                    error=error, csrf=_csrf(login_of(request)))

    async def run(request: Request) -> Response:
        return await show_run(request)

    async def diagram(request: Request) -> Response:
        run_id = request.query_params.get("id", "")
        try:
            found = await run_in_threadpool(views.run_page, console.reads, run_id)
        except RunNotFound:
            return Response("no such run", status_code=404, media_type="text/plain")
        return Response(found.diagram, media_type="image/svg+xml")

    async def stylesheet(request: Request) -> Response:
        return Response((HERE / "static" / "console.css").read_text(encoding="utf-8"),
                        media_type="text/css")

    # ------------------------------------------------------------ logging in and out

    async def login_form(request: Request) -> Response:
        return page(request, "login.html", title="Log in", error=None,
                    next=_local(request.query_params.get("next")))

    async def login(request: Request) -> Response:
        assert console.logins is not None
        try:
            _same_origin(request)
            form = await _form(request)
        except Refused as refused:
            return page(request, "login.html", refused.status, title="Log in",
                        error=str(refused), next="/runs")
        target = _local(form.get("next"))
        name = str(form.get("name", "")).strip()
        if not console.logins.token_matches(str(form.get("token", ""))):
            return page(request, "login.html", 403, title="Log in", next=target,
                        error="that is not the console's token")
        if not name or len(name) > MAX_NAME or not name.isprintable():
            return page(request, "login.html", 400, title="Log in", next=target,
                        error=f"give your name (printable, {MAX_NAME} characters at most)")
        session, _ = console.logins.open(name)
        response = RedirectResponse(_with_done(target, "login"), 303)
        response.set_cookie(COOKIE, session, max_age=LOGIN_SECONDS, httponly=True,
                            samesite="strict", path="/")
        return response

    async def logout(request: Request) -> Response:
        assert console.logins is not None
        try:
            _same_origin(request)
            form = await _form(request)
            login = login_of(request)
            if login is None or not csrf_matches(login, _text(form, "csrf")):
                raise Refused(403, "not logged in, or the form is not this login's")
        except Refused as refused:
            return page(request, "error.html", refused.status, title="Log out",
                        message=str(refused))
        console.logins.close(request.cookies.get(COOKIE))
        response = RedirectResponse("/runs?done=logout", 303)
        response.delete_cookie(COOKIE, path="/")
        return response

    # ------------------------------------------------------------ the four writes

    def action(verb: str, act: Callable[[FormData, str, str, int], None]) -> Handler:
        async def handler(request: Request) -> Response:
            run_id = ""
            try:
                _same_origin(request)
                form = await _form(request)
                run_id = _text(form, "run_id") or ""
                login = login_of(request)
                if login is None:
                    raise Refused(403, "log in with the console's token to act")
                if not csrf_matches(login, _text(form, "csrf")):
                    raise Refused(403, "this form is not from this login's page (CSRF "
                                       "token missing or wrong): open the page again")
                by = (_text(form, "by") or login.name).strip()
                if not by or len(by) > MAX_NAME:
                    raise Refused(400, f"by: who decides, {MAX_NAME} characters at most")
                seen = _seen(form)
                await run_in_threadpool(act, form, run_id, by, seen)
            except Refused as refused:
                if not run_id:
                    return page(request, "error.html", refused.status, title="Refused",
                                message=str(refused))
                return await show_run(request, refused.status,
                                      ("Refused", str(refused)), run_id=run_id)
            except RunNotFound as error:
                return page(request, "error.html", 404, title="No such run",
                            message=f"{type(error).__name__}: {error}")
            except ControlError as error:
                return await show_run(request, 409, (type(error).__name__, str(error)),
                                      run_id=run_id)
            return RedirectResponse(f"/run?id={quote(run_id, safe='')}&done={verb}", 303)

        return handler

    writes: Any = console.writes

    def approve(form: FormData, run_id: str, by: str, seen: int) -> None:
        operator.approve(writes, run_id, _required(form, "call_id"),
                         fingerprint=_required(form, "fingerprint"), by=by,
                         reason=_text(form, "reason") or None, seen=seen)

    def reject(form: FormData, run_id: str, by: str, seen: int) -> None:
        operator.reject(writes, run_id, _required(form, "call_id"), by=by,
                        message=_text(form, "message") or None, seen=seen)

    def resolve(form: FormData, run_id: str, by: str, seen: int) -> None:
        outcome, output = _outcome(form)
        operator.resolve(writes, run_id, _required(form, "call_id"),
                         outcome=outcome, output=output, by=by,
                         evidence=_text(form, "evidence") or None, seen=seen)

    def abandon(form: FormData, run_id: str, by: str, seen: int) -> None:
        operator.abandon(writes, run_id, reason=_required(form, "reason"), by=by,
                         seen=seen)

    routes = [
        Route("/", guarded(home)),
        Route("/runs", guarded(runs)),
        Route("/inbox", guarded(inbox)),
        Route("/run", guarded(run)),
        Route("/run/diagram.svg", guarded(diagram)),
        Route("/static/console.css", guarded(stylesheet, reading=False)),
    ]
    if console.logins is not None:
        routes += [
            Route("/login", guarded(login_form, reading=False), methods=["GET"]),
            Route("/login", guarded(login, reading=False), methods=["POST"]),
            Route("/logout", guarded(logout, reading=False), methods=["POST"]),
        ]
    if console.writes is not None:
        for verb, act in (("approve", approve), ("reject", reject), ("resolve", resolve),
                          ("abandon", abandon)):
            routes.append(Route(f"/act/{verb}", guarded(action(verb, act), reading=False),
                                methods=["POST"]))
    return Starlette(routes=routes)


# ------------------------------------------------------------------ form handling


def _csrf(login: Login | None) -> str | None:
    return None if login is None else login.csrf


def _local(target: object) -> str:
    """``target`` if it is a path on this console (never another site), else ``/runs``."""
    if not isinstance(target, str) or not target.startswith("/") or target.startswith("//"):
        return "/runs"
    if "\\" in target or any(not c.isprintable() for c in target):
        return "/runs"
    parts = urlsplit(target)
    return target if not parts.scheme and not parts.netloc else "/runs"


def _with_done(target: str, verb: str) -> str:
    return f"{target}{'&' if '?' in target else '?'}done={verb}"


def _same_origin(request: Request) -> None:
    """A cross-site write is refused: an ``Origin`` (or, without one, a ``Referer``)
    that names another host than the one the request was sent to."""
    host = request.headers.get("host", "").lower()
    origin = request.headers.get("origin") or request.headers.get("referer")
    if origin is None:
        return
    if origin == "null" or urlsplit(origin).netloc.lower() != host:
        raise Refused(403, "a write from another site is refused (its Origin is not this "
                           "console)")


async def _form(request: Request) -> FormData:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_FORM):
        raise Refused(413, f"the form is larger than {MAX_FORM} bytes")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise Refused(415, "a form is sent as application/x-www-form-urlencoded")
    body = await request.body()
    if len(body) > MAX_FORM:
        raise Refused(413, f"the form is larger than {MAX_FORM} bytes")
    return await request.form(max_files=0, max_fields=50, max_part_size=MAX_FORM)


def _text(form: FormData, name: str) -> str | None:
    """A field's text (the first, when it was sent more than once), or None."""
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise Refused(400, f"{name} is text, not a file")
    return value


def _required(form: FormData, name: str) -> str:
    value = _text(form, name)
    if not value or not value.strip():
        raise Refused(400, f"{name} is required")
    return value


def _seen(form: FormData) -> int:
    text = _required(form, "seen").strip()
    if not text.isdigit() or len(text) > 18:
        raise Refused(400, "seen: the version the page showed, a whole number")
    return int(text)


def _outcome(form: FormData) -> tuple[Resolution, Any]:
    """The outcome and output a resolve form gives: ``completed`` with JSON, ``failed``
    with a text, ``not_executed`` with none (an output given with it is refused: the
    form says two things)."""
    outcome = _required(form, "outcome")
    output = _text(form, "output") or ""
    if outcome == Resolution.COMPLETED.value:
        if not output.strip():
            raise Refused(400, "completed needs the output the model sees, as JSON "
                               '(a text is "...")')
        return Resolution.COMPLETED, parse(output)
    if outcome == Resolution.FAILED.value:
        if not output.strip():
            raise Refused(400, "failed needs the error text the model sees")
        return Resolution.FAILED, output
    if outcome == Resolution.NOT_EXECUTED.value:
        if output.strip():
            raise Refused(400, "not executed takes no output (the call runs again): clear "
                               "the output, or choose completed or failed")
        return Resolution.NOT_EXECUTED, None
    raise Refused(400, "outcome is one of completed, failed, not_executed")


def loopback_hosts(host: str, port: int) -> frozenset[str]:
    """The ``Host`` headers a console bound to ``host``:``port`` on loopback answers."""
    names = {host.lower(), "localhost", "127.0.0.1", "[::1]"}
    return frozenset(n for name in names for n in (name, f"{name}:{port}"))


def hosts_for(host: str, port: int, *, private: bool) -> Collection[str] | None:
    """None (any host) for a console behind a login; loopback names otherwise."""
    return None if private else loopback_hosts(host, port)
