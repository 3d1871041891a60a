"""The console in a real headless browser (Debian's Chromium through its ChromeDriver),
against ``statemachine serve`` started as a person would, JavaScript off as the console
promises to work: log in with the token it printed, settle a call in doubt with
evidence, approve a call, and be refused on a stale page, without the login or without
the form's CSRF token; the read-only console offers and serves no write. Outcomes are
read off the store's log, not off the pages. Under CI a skip (no browser here) fails.

``STATEMACHINE_SCREENSHOTS=DIR`` also keeps a screenshot of each page in DIR (the ones
under ``docs/`` in the README are made so)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.wait import WebDriverWait

from statemachine import SQLiteEventStore, operator
from statemachine import events as ev
from statemachine.values import Resolution
from tests.console.pages import log
from tests.console.world import Seeded, seed

pytestmark = pytest.mark.browser



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """``statemachine serve`` on a free loopback port, until the test ends."""

    def __init__(self, folder: Path, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._err = folder / f"serve-{self.port}.err"
        with self._err.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "statemachine", "serve", "--port", str(self.port),
                 *args], stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/static/console.css", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"serve did not start: {self._err.read_text()}"
                                       ) from None
                time.sleep(0.1)

    @property
    def token(self) -> str:
        for line in self._err.read_text().splitlines():
            if line.startswith("log in with the token: "):
                return line.removeprefix("log in with the token: ").strip()
        raise AssertionError(f"serve printed no token: {self._err.read_text()}")

    def post(self, path: str, fields: dict[str, str]) -> int:
        """A plain POST, as a script on another page (or curl) would send it."""
        body = urllib.parse.urlencode(fields).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _program(name: str) -> str:
    found = shutil.which(name) or shutil.which(f"{name}-browser")
    if found is None:
        pytest.skip(f"no {name} here: install Debian's chromium and chromium-driver")
    return found


@pytest.fixture(scope="module")
def programs() -> tuple[str, str]:
    return _program("chromium"), _program("chromedriver")


def _browser(programs: tuple[str, str], folder: Path, *, javascript: bool) -> Any:
    options = webdriver.ChromeOptions()
    options.binary_location = programs[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,1000",
                 f"--user-data-dir={folder}"):
        options.add_argument(flag)
    if not javascript:
        options.add_experimental_option(
            "prefs", {"profile.managed_default_content_settings.javascript": 2})
    driver = webdriver.Chrome(service=Service(programs[1]), options=options)
    driver.set_page_load_timeout(30)
    driver.implicitly_wait(10)
    return driver


def _submit(driver: Any, button: Any) -> None:
    """Click a form's button and wait until the page it leads to has replaced this one
    (a click returns before the browser has navigated)."""
    page = driver.find_element(By.TAG_NAME, "html")
    button.click()
    # while the browser swaps documents, asking about the old one may fail otherwise than
    # as stale (an inspector error): ask again
    WebDriverWait(driver, 20, ignored_exceptions=(WebDriverException,)).until(
        staleness_of(page))


@pytest.fixture
def world(tmp_path: Path) -> Seeded:
    return seed(tmp_path)


@pytest.fixture
def served(world: Seeded, tmp_path: Path) -> Iterator[Served]:
    server = Served(tmp_path, "--store", str(world.path))
    yield server
    server.stop()


@pytest.fixture
def browser(programs: tuple[str, str], tmp_path: Path) -> Iterator[Any]:
    driver = _browser(programs, tmp_path / "profile", javascript=False)
    yield driver
    driver.quit()


def _shot(driver: Any, name: str) -> None:
    folder = os.environ.get("STATEMACHINE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        height = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        driver.set_window_size(1280, min(2400, int(height["height"]) + 40))
        driver.execute_cdp_cmd("Runtime.evaluate", {"expression": "window.scrollTo(0, 0)"})
        driver.save_screenshot(str(Path(folder) / f"console-{name}.png"))
        driver.set_window_size(1280, 1000)


def _log_in(driver: Any, server: Served, name: str) -> None:
    driver.get(f"{server.url}/login")
    driver.find_element(By.NAME, "token").send_keys(server.token)
    driver.find_element(By.NAME, "name").send_keys(name)
    _submit(driver, driver.find_element(By.CSS_SELECTOR, "form button[type=submit]"))
    assert driver.find_element(By.ID, "acting-as").text == name


def _inbox(driver: Any, server: Served) -> set[tuple[str, str]]:
    driver.get(f"{server.url}/inbox")
    return {(row.find_elements(By.TAG_NAME, "td")[1].text,
             row.find_elements(By.TAG_NAME, "td")[2].text)
            for row in driver.find_elements(By.CSS_SELECTOR, "#inbox tbody tr")}


def _refusal(driver: Any) -> str:
    return str(driver.find_element(By.ID, "refused").text)


def test_settle_a_call_in_doubt_and_approve_one(browser: Any, served: Served,
                                                world: Seeded) -> None:
    _log_in(browser, served, "ann")
    assert _inbox(browser, served) == set(world.approvals) | set(world.in_doubt)
    _shot(browser, "inbox")
    browser.get(f"{served.url}/runs")
    _shot(browser, "runs")
    browser.get(f"{served.url}/inbox")
    _submit(browser, browser.find_element(By.LINK_TEXT, "order-17"))
    form = browser.find_element(By.CSS_SELECTOR, "form.resolve")
    form.find_element(By.CSS_SELECTOR, "input[value=completed]").click()
    form.find_element(By.NAME, "output").send_keys('{"payment": "pay_1"}')
    form.find_element(By.NAME, "evidence").send_keys("stripe pay_1")
    _shot(browser, "run")
    _submit(browser, form.find_element(By.CSS_SELECTOR, "button[type=submit]"))
    assert browser.find_element(By.CSS_SELECTOR, ".done").text == "Resolved."
    resolved = log(world.path, "order-17")[-1]
    assert isinstance(resolved, ev.InDoubtResolved)
    assert (resolved.by, resolved.outcome, resolved.evidence, resolved.output) == (
        "ann", Resolution.COMPLETED, "stripe pay_1", {"payment": "pay_1"})
    newest = browser.find_elements(By.CSS_SELECTOR, "#timeline tbody tr")[0]
    cells = [td.text for td in newest.find_elements(By.TAG_NAME, "td")]
    assert (cells[1], cells[3]) == ("InDoubtResolved", "ann")
    assert ("order-17", "charge") not in _inbox(browser, served)

    browser.get(f"{served.url}/run?id=order-19")
    shown = browser.find_element(By.CSS_SELECTOR, "#call-wire .fingerprint").text
    _submit(browser, browser.find_element(By.CSS_SELECTOR, "form.approve button[type=submit]"))
    assert browser.find_element(By.CSS_SELECTOR, ".done").text == "Approved."
    approved = log(world.path, "order-19")[-1]
    assert isinstance(approved, ev.CallApproved)
    assert (approved.call_id, approved.by, approved.fingerprint) == ("wire", "ann", shown)
    assert ("order-19", "wire") not in _inbox(browser, served)


def test_a_stale_page_and_a_write_without_the_login_are_refused(
        browser: Any, served: Served, world: Seeded) -> None:
    _log_in(browser, served, "ann")
    browser.get(f"{served.url}/run?id=order-18")
    # someone else rejects the other call while the page is open
    operator.reject(SQLiteEventStore(world.path), "order-18", "email", by="carol")
    before = log(world.path, "order-18")
    _submit(browser, browser.find_element(By.CSS_SELECTOR, "#call-refund form.approve button"))
    assert "ConcurrencyConflict" in _refusal(browser)
    assert log(world.path, "order-18") == before
    # the page shown with the refusal is read again: its form binds the run as it is
    _submit(browser, browser.find_element(By.CSS_SELECTOR, "#call-refund form.approve button"))
    assert browser.find_element(By.CSS_SELECTOR, ".done").text == "Approved."
    assert isinstance(log(world.path, "order-18")[-1], ev.CallApproved)

    browser.get(f"{served.url}/run?id=order-19")
    browser.delete_all_cookies()  # the login's cookie is gone: the form is as it was
    _submit(browser, browser.find_element(By.CSS_SELECTOR, "form.approve button"))
    assert "log in" in _refusal(browser)
    assert log(world.path, "order-19")[-1].seq == len(log(world.path, "order-19")) - 1
    assert not isinstance(log(world.path, "order-19")[-1], ev.CallApproved)


def test_a_form_without_its_csrf_token_is_refused(programs: tuple[str, str],
                                                  served: Served, world: Seeded,
                                                  tmp_path: Path) -> None:
    driver = _browser(programs, tmp_path / "scripted", javascript=True)
    try:
        _log_in(driver, served, "mallory")
        driver.get(f"{served.url}/run?id=order-19")
        before = log(world.path, "order-19")
        # what a forged form lacks: the login's CSRF token (the cookie still goes along)
        driver.execute_script(
            "document.querySelectorAll('form.approve input[name=csrf]')"
            ".forEach(e => e.remove())")
        _submit(driver, driver.find_element(By.CSS_SELECTOR, "form.approve button"))
        assert "CSRF" in _refusal(driver)
        assert log(world.path, "order-19") == before
    finally:
        driver.quit()
    # and a plain POST from outside the browser, with no login at all
    assert served.post("/act/approve", {"run_id": "order-19", "call_id": "wire",
                                        "seen": "3", "fingerprint": "0" * 64}) == 403
    assert log(world.path, "order-19") == before


def test_the_read_only_console_offers_no_write(browser: Any, world: Seeded,
                                               tmp_path: Path) -> None:
    server = Served(tmp_path, "--store", str(world.path), "--read-only")
    browser.implicitly_wait(0)  # each page is loaded: looking for what is not there
    try:
        for url in ("/runs", "/inbox", "/run?id=order-17", "/run?id=order-19"):
            browser.get(f"{server.url}{url}")
            assert browser.find_elements(By.CSS_SELECTOR, "form[method=post]") == []
        assert browser.find_element(By.CSS_SELECTOR, ".who").text == "read-only"
        before = {run_id: log(world.path, run_id) for run_id in world.runs}
        for verb in ("approve", "reject", "resolve", "abandon"):
            assert server.post(f"/act/{verb}", {"run_id": "order-19"}) == 404
        assert server.post("/login", {"token": "x" * 20, "name": "x"}) == 404
        assert {run_id: log(world.path, run_id) for run_id in world.runs} == before
    finally:
        server.stop()


def test_a_form_acts_on_the_run_and_call_its_page_shows_line_breaks_and_all(
        browser: Any, tmp_path: Path) -> None:
    """Ids may hold line breaks, and a browser rewrites them in a form's fields (CR to
    LF, then LF to CRLF on the way out). Two runs whose ids differ by a CR alone, each
    with a call in doubt whose id holds a line break: settling the call on the first
    run's page records the decision on that run and that call, the other run left as it
    was. Before, the form sent the ids as they were, and the decision landed on the
    other run (its call then ran again)."""
    from statemachine import RunController, ToolCall

    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    shown, other, call = "pay\nA", "pay\r\nA", "charge\n1"
    for run_id in (shown, other):
        c = RunController.start(run_id=run_id, session_id=None, store=store)
        c.claim("worker-1")
        c.begin_model_call()
        c.model_responded([ToolCall(call, "charge_card", {"amount": 7})])
        c.begin_tool(call)  # the worker died in the body
    store.close()
    before = log(path, other)
    server = Served(tmp_path, "--store", str(path))
    try:
        _log_in(browser, server, "ann")
        browser.get(f"{server.url}/run?id={urllib.parse.quote(shown, safe='')}")
        form = browser.find_element(By.CSS_SELECTOR, "form.resolve")
        form.find_element(By.CSS_SELECTOR, "input[value=not_executed]").click()
        form.find_element(By.NAME, "evidence").send_keys("no charge at the bank")
        _submit(browser, form.find_element(By.CSS_SELECTOR, "button[type=submit]"))
        assert browser.find_element(By.CSS_SELECTOR, ".done").text == "Resolved."
    finally:
        server.stop()
    resolved = log(path, shown)[-1]
    assert isinstance(resolved, ev.InDoubtResolved)
    assert (resolved.call_id, resolved.by, resolved.outcome, resolved.evidence) == (
        call, "ann", Resolution.NOT_EXECUTED, "no charge at the bank")
    assert log(path, other) == before
