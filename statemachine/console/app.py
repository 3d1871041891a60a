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

import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import attrs
import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from statemachine import operator
from statemachine.cli.common import UserError, chosen_steps
from statemachine.codec import parse
from statemachine.console import views
from statemachine.console.auth import COOKIE, LOGIN_SECONDS, MAX_NAME, Login, Logins, csrf_matches
from statemachine.controller import RunController
from statemachine.errors import ControlError, RunNotFound
from statemachine.payloads import misprints
from statemachine.values import Resolution

HERE = Path(__file__).parent
MAX_FORM = 1_048_576
"""The largest form body a write accepts (bytes)."""
MAX_FIELDS = 50
"""The most fields a form may send."""
_DIGITS = re.compile("[0-9]+")
POLICY = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
          "frame-ancestors 'none'; base-uri 'none'")
Handler = Callable[[Request], Awaitable[Response]]
Form = dict[str, str]


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be who decides (None: it can): empty, longer than `MAX_NAME`,
    or holding a character that prints as something else or nothing (a control, a
    direction override, a line break): the name recorded is the name shown."""
    if not name.strip():
        return "it is empty"
    if len(name) > MAX_NAME:
        return f"it is longer than {MAX_NAME} characters"
    if any(misprints(c) for c in name):
        return "it holds a character that does not print as itself"
    return None


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
    env.filters["v"] = views.visible
    return env


def create_app(console: Console) -> Starlette:
    """The application serving ``console``."""
    env = _environment()

    def login_of(request: Request) -> Login | None:
        if console.logins is None:
            return None
        return console.logins.find(request.cookies.get(COOKIE))

    def page(request: Request, template: str, status: int = 200, *,
             done: str | None = None, **values: Any) -> Response:
        login = login_of(request)
        html = env.get_template(template).render(
            login=login, writable=console.writes is not None,
            can_login=console.logins is not None, path=request.url.path, done=done,
            **values)
        return HTMLResponse(html, status_code=status)

    def failed(request: Request, error: ControlError) -> Response:
        """The store could not be read (or refused): the typed error, as a page."""
        status = 404 if isinstance(error, RunNotFound) else 503
        title = "No such run" if isinstance(error, RunNotFound) else "The store failed"
        return page(request, "error.html", status, title=title,
                    message=f"{type(error).__name__}: {error}")

    def guarded(handler: Handler, *, reading: bool = True) -> Handler:
        async def wrapped(request: Request) -> Response:
            host = request.headers.get("host", "")
            if console.hosts is not None and host.lower() not in console.hosts:
                return HTMLResponse("unknown host", status_code=421)
            if reading and console.private and login_of(request) is None:
                target = request.url.path + (f"?{request.url.query}" if request.url.query
                                             else "")
                return RedirectResponse(f"/login?next={quote(target, safe='')}", 303)
            try:
                response = await handler(request)
            except ControlError as error:  # a store that fails while serving
                response = failed(request, error)
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
        except UserError as error:  # an unknown step
            return page(request, "error.html", 400, title="Runs", message=str(error))
        kind = request.query_params.get("kind") or None
        if kind is not None and kind not in views.KINDS:
            return page(request, "error.html", 400, title="Runs",
                        message=f"kind is one of {', '.join(views.KINDS)}")
        blocked = request.query_params.get("blocked") in ("1", "on", "true")
        found = await run_in_threadpool(views.runs_page, console.reads, steps=steps,
                                        blocked=blocked, kind=kind, now=console.clock())
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
        except ControlError as failure:
            if error is None:
                return failed(request, failure)
            # a refusal whose run can no longer be read: the refusal, on its own
            return page(request, "error.html", status, title="Refused",
                        message=f"{error[0]}: {error[1]} Nothing was changed.")
        done = None
        if error is None:  # "done" only when the log shows it: a link cannot claim it
            done = found.done(request.query_params.get("done", ""),
                              request.query_params.get("seq", ""))
        return page(request, "run.html", status, run=found,
                    title=f"Run {views.visible(run_id)}", error=error, done=done,
                    csrf=_csrf(login_of(request)))

    async def run(request: Request) -> Response:
        return await show_run(request)

    async def diagram(request: Request) -> Response:
        run_id = request.query_params.get("id", "")
        try:
            drawn = await run_in_threadpool(views.run_diagram, console.reads, run_id)
        except RunNotFound:
            return Response("no such run", status_code=404, media_type="text/plain")
        return Response(drawn, media_type="image/svg+xml")

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
        name = form.get("name", "").strip()
        if not console.logins.token_matches(form.get("token", "")):
            return page(request, "login.html", 403, title="Log in", next=target,
                        error="that is not the console's token")
        if (problem := name_problem(name)) is not None:
            return page(request, "login.html", 400, title="Log in", next=target,
                        error=f"give your name: {problem}")
        session, _ = console.logins.open(name)
        response = RedirectResponse(target, 303)
        response.set_cookie(COOKIE, session, max_age=LOGIN_SECONDS, httponly=True,
                            samesite="strict", path="/")
        return response

    async def logout(request: Request) -> Response:
        assert console.logins is not None
        try:
            _same_origin(request)
            login = login_of(request)
            if login is None:
                raise Refused(403, "not logged in")
            form = await _form(request)
            if not csrf_matches(login, form.get("csrf")):
                raise Refused(403, "this form is not from this login's page")
        except Refused as refused:
            return page(request, "error.html", refused.status, title="Log out",
                        message=str(refused))
        console.logins.close(request.cookies.get(COOKIE))
        response = RedirectResponse("/runs", 303)
        response.delete_cookie(COOKIE, path="/")
        return response

    # ------------------------------------------------------------ the four writes

    def action(verb: str, act: Callable[[Form, str, str, int], RunController]) -> Handler:
        async def handler(request: Request) -> Response:
            # who first, before reading a byte of the body: without a login nothing of
            # the store is read or shown (a private console's runs included)
            login = login_of(request)
            if login is None:
                return page(request, "error.html", 403, title="Refused",
                            message="log in with the console's token to act")
            run_id = ""
            try:
                _same_origin(request)
                form = await _form(request)
                if not csrf_matches(login, form.get("csrf")):
                    raise Refused(403, "this form is not from this login's page (CSRF "
                                       "token missing or wrong): open the page again")
                run_id = _id(form, "run_id")
                seen = _seen(form)
                done = await run_in_threadpool(act, form, run_id, login.name, seen)
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
            target = (f"/run?id={quote(run_id, safe='')}&done={verb}"
                      f"&seq={done.version - 1}")
            return RedirectResponse(target, 303)

        return handler

    writes: Any = console.writes

    def approve(form: Form, run_id: str, by: str, seen: int) -> RunController:
        return operator.approve(writes, run_id, _id(form, "call_id"),
                                fingerprint=_required(form, "fingerprint"), by=by,
                                reason=form.get("reason") or None, seen=seen)

    def reject(form: Form, run_id: str, by: str, seen: int) -> RunController:
        return operator.reject(writes, run_id, _id(form, "call_id"), by=by,
                               message=form.get("message") or None, seen=seen)

    def resolve(form: Form, run_id: str, by: str, seen: int) -> RunController:
        outcome, output = _outcome(form)
        return operator.resolve(writes, run_id, _id(form, "call_id"),
                                outcome=outcome, output=output, by=by,
                                evidence=form.get("evidence") or None, seen=seen)

    def abandon(form: Form, run_id: str, by: str, seen: int) -> RunController:
        return operator.abandon(writes, run_id, reason=_required(form, "reason"), by=by,
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


async def _form(request: Request) -> Form:
    """The urlencoded form a request sends, read no further than `MAX_FORM` bytes (413
    past it, with or without a Content-Length); 400 for a body that is not UTF-8, holds
    more than `MAX_FIELDS` fields or names one twice (a form that says two things)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not _DIGITS.fullmatch(declared) or int(declared) > MAX_FORM):
        raise Refused(413, f"the form is larger than {MAX_FORM} bytes")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise Refused(415, "a form is sent as application/x-www-form-urlencoded")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            raise Refused(413, f"the form is larger than {MAX_FORM} bytes")
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True,
                          max_num_fields=MAX_FIELDS, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise Refused(400, f"the form is not UTF-8 text of {MAX_FIELDS} fields at most"
                      ) from None
    form = dict(pairs)
    if len(form) != len(pairs):
        raise Refused(400, "the form names a field twice")
    return form


def _required(form: Form, name: str) -> str:
    value = form.get(name)
    if not value or not value.strip():
        raise Refused(400, f"{name} is required")
    return value


_QUOTED = re.compile(r"(?:[A-Za-z0-9_.~-]|%[0-9A-Fa-f]{2})*")
"""A percent-encoded text (the ``q`` filter): nothing in it a browser rewrites."""


def _id(form: Form, name: str) -> str:
    """The run or call id a page's form carries, percent-encoded (the ``q`` filter) so
    that it comes back as the page had it: a browser rewrites the line breaks of a
    form's fields (CR to LF, then LF to CRLF), and an id may hold them, so an id sent
    as it is could come back as another run's. A value that is not such an encoding, or
    decodes to no UTF-8 text, is refused (400), nothing done; empty, it is refused as
    missing."""
    value = _required(form, name)
    if not _QUOTED.fullmatch(value):
        raise Refused(400, f"{name} did not come back as the page wrote it: open the "
                           "page again")
    try:
        return unquote(value, errors="strict")
    except UnicodeDecodeError:
        raise Refused(400, f"{name} is not UTF-8 text") from None


def _seen(form: Form) -> int:
    text = _required(form, "seen").strip()
    if not _DIGITS.fullmatch(text) or len(text) > 18:
        raise Refused(400, "seen: the version the page showed, a whole number")
    return int(text)


def _outcome(form: Form) -> tuple[Resolution, Any]:
    """The outcome and output a resolve form gives: ``completed`` with JSON, ``failed``
    with a text, ``not_executed`` with none (an output given with it is refused: the
    form says two things)."""
    outcome = _required(form, "outcome")
    output = form.get("output") or ""
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
