"""JupyterLab in a real browser: learner copies from `python -m course_lib start`, headless Chromium.

Debian's `chromium` and `chromium-driver` packages, driven by Selenium through the packaged driver:
nothing downloads a browser. Notebook 01 runs to the end with live widgets (no error output in the
page), the query explorer redraws when its slider is dragged, notebook 08 runs to the end, and the
browser's console shows no error. Screenshots go to COURSE_BROWSER_SHOTS (default build/browser/),
which `make browser` names in its log.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SHOTS = Path(os.environ.get("COURSE_BROWSER_SHOTS") or ROOT / "build" / "browser")
RUN_TIMEOUT = float(os.environ.get("COURSE_BROWSER_TIMEOUT", 600))   # seconds for one Run All (08 trains four GPTs)

if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("no Chromium: apt-get install chromium chromium-driver (Debian) to run the browser test",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on fresh learner copies, as a student starts it, in a home of its own."""
    base = tmp_path_factory.mktemp("browser")
    home = base / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("COURSE_STATIC_WIDGETS", "MPLBACKEND") and not k.startswith(("JUPYTER", "PYTEST"))}
    # PYTHONPATH: the checkout first, then what the Makefile put there (the train-replay hook, when set)
    env.update(HOME=str(home), COURSE_THREADS=env.get("COURSE_THREADS", "2"),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
    started = subprocess.run([sys.executable, "-m", "course_lib", "start", "class"], cwd=base, env=env,
                             capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    copies = base / "class"
    port, token = _free_port(), secrets.token_hex(16)
    log = open(base / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={copies}", "--allow-root",
         "--LabApp.expose_app_in_browser=True"],   # window.jupyterapp: Run All through Lab's own command
        cwd=copies, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                log.close()
                pytest.fail("JupyterLab did not start:\n" + (base / "jupyterlab.log").read_text()[-3000:])
            time.sleep(0.5)
    yield {"url": url, "token": token, "copies": copies}
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()


@pytest.fixture(scope="module")
def browser():
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                 "--disable-gpu"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")   # Selenium Manager never fetches a driver or a browser
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_script_timeout(60)
    SHOTS.mkdir(parents=True, exist_ok=True)
    print(f"browser test screenshots: {SHOTS}")
    yield driver
    driver.quit()


CURRENT = "const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"


def _wait(driver, script: str, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.5)
    driver.save_screenshot(str(SHOTS / f"timeout-{what.replace(' ', '-')}.png"))
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def _open_and_run_all(driver, lab: dict, name: str) -> list[dict]:
    """Open a learner copy, Run All as a student would, wait until the kernel is done; its cells' outputs."""
    driver.get(f"{lab['url']}/lab/tree/{name}?token={lab['token']}")
    _wait(driver, CURRENT + f"return w && w.context && w.context.path === {json.dumps(name)} && "
                            "w.sessionContext.session && w.sessionContext.session.kernel && "
                            "w.sessionContext.session.kernel.status === 'idle';", 180, f"the kernel of {name}")
    driver.execute_script(CURRENT + "window.jupyterapp.commands.execute('notebook:run-all-cells');")
    # Done: the kernel idle and no cell waiting ("[*]"), twice in a row a second apart.
    done = (CURRENT + "return w.sessionContext.session.kernel.status === 'idle' && "
            "![...document.querySelectorAll('.jp-InputPrompt')].some(p => p.textContent.includes('*'));")
    deadline = time.monotonic() + RUN_TIMEOUT
    while True:
        _wait(driver, done, max(1.0, deadline - time.monotonic()), f"Run All of {name}")
        time.sleep(1.0)
        if driver.execute_script(done):
            break
    return driver.execute_script(CURRENT + "return w.content.widgets.map(c => ({type: c.model.type, "
                                 "count: c.model.executionCount === undefined ? null : c.model.executionCount, "
                                 "outputs: c.model.type === 'code' ? c.model.outputs.toJSON() : []}));")


# Notebook 01's query explorer, found anew by every script that uses it (as `e`).
EXPLORER = ("const e = [...document.querySelectorAll('.widget-vbox')].find(b => "
            "b.querySelector('.widget-slider') && b.textContent.includes('query angle') && "
            "b.querySelector('.widget-output img'));")
STALE_WAIT = 30.0   # seconds a redraw may keep replacing what a step looks up


def _unstale(driver, step, what: str, timeout: float = STALE_WAIT):
    """Run `step`, which looks up the elements it needs itself, again while a redraw made one stale."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return step()
        except StaleElementReferenceException:
            ActionChains(driver).reset_actions()   # release a button a failed drag may have pressed
            if time.monotonic() > deadline:
                driver.save_screenshot(str(SHOTS / f"stale-{what.replace(' ', '-')}.png"))
                pytest.fail(f"{what}: the page kept redrawing for {timeout:.0f} s")
            time.sleep(0.2)


def _read_explorer(driver, expression: str) -> str:
    """One value read from the explorer as it is now: a string, so nothing is held that a redraw could make
    stale; while a redraw has it half-drawn, read again (bounded)."""
    return _wait(driver, EXPLORER + f"try {{ return e ? {expression} : null; }} catch (_) {{ return null; }}",
                 STALE_WAIT, "the query explorer after a redraw")


def _assert_ran_without_errors(driver, cells: list[dict], name: str) -> None:
    code = [c for c in cells if c["type"] == "code"]
    assert code and all(c["count"] is not None for c in code), f"{name}: not every code cell ran"
    errors = [f"{o['ename']}: {o['evalue']}" for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, f"{name}: error output in the page: {errors}"
    shown = driver.execute_script("return [...document.querySelectorAll('.jp-OutputArea-output')]"
                                  ".map(e => e.textContent).filter(t => t.includes('Traceback'));")
    assert not shown, f"{name}: a traceback is shown in the page: {shown[0][:500]}"


def _console_errors(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_notebook_01_runs_in_jupyterlab_and_the_query_explorer_redraws(lab, browser):
    cells = _open_and_run_all(browser, lab, "01_attention_toy.ipynb")
    browser.save_screenshot(str(SHOTS / "01-run-all.png"))
    _assert_ran_without_errors(browser, cells, "01_attention_toy.ipynb")

    # The explorer: an ipywidgets slider above an Output holding the figure. Every redraw replaces the
    # figure (and may re-render the box), so nothing found in the page is held across one: each read
    # looks the explorer up again.
    _wait(browser, EXPLORER + "return e && e.querySelector('.widget-output img');", 60, "the query explorer")
    browser.execute_script(EXPLORER + "e.scrollIntoView({block: 'center'});")
    figure = lambda: _read_explorer(browser, "e.querySelector('.widget-output img').getAttribute('src')")  # noqa: E731
    readout = lambda: _read_explorer(browser, "e.querySelector('.widget-readout').textContent")  # noqa: E731
    before_figure, before_angle = figure(), readout()

    def drag() -> None:
        handle = browser.execute_script(EXPLORER + "return e.querySelector('.noUi-handle');")
        ActionChains(browser).click_and_hold(handle).move_by_offset(40, 0).move_by_offset(60, 0).release().perform()

    _unstale(browser, drag, "dragging the explorer's slider")
    deadline = time.monotonic() + 60
    while (readout() == before_angle or figure() == before_figure) and time.monotonic() < deadline:
        time.sleep(0.5)
    _wait(browser, CURRENT + "return w.sessionContext.session.kernel.status === 'idle';", 60,
          "the explorer's last redraw")   # the screenshot shows the figure of the final angle
    browser.save_screenshot(str(SHOTS / "01-explorer-dragged.png"))
    assert readout() != before_angle, "dragging the slider did not move it"
    assert figure() != before_figure, f"the figure did not change when the angle went {before_angle} -> {readout()}"
    assert not _console_errors(browser)


def test_notebook_08_runs_to_the_end_in_jupyterlab(lab, browser):
    cells = _open_and_run_all(browser, lab, "08_train_your_gpt.ipynb")
    browser.save_screenshot(str(SHOTS / "08-run-all.png"))
    _assert_ran_without_errors(browser, cells, "08_train_your_gpt.ipynb")
    assert not _console_errors(browser)
