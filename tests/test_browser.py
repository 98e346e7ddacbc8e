"""JupyterLab in a real browser: the learner's workspace, headless JupyterLab, Debian's Chromium via Selenium.

Opens notebook 00 and lab 1 (with exercise 1 filled in, as a learner would) from a fresh workspace, runs all
cells from JupyterLab's own "Run All", and checks what the learner sees: no error output, the header, and the
exercise marks (✓ for the done exercise, "not done yet" for the others).

Needs `chromium` and `chromedriver` (Debian: apt-get install chromium chromium-driver), selenium and jupyterlab.
Skips, saying what is missing, in a local run; fails in CI (CI=true), where .ci/run installs them.
A screenshot of each notebook goes to build/browser/ (for looking at what the browser saw).
"""
import importlib.util
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from cellrun import jupyter_lab
from course.tools import workspace

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "build" / "browser"
RUN_TIMEOUT = 600  # seconds for all cells of one notebook (lab 1 on the simulator takes about a minute)


def _missing() -> list:
    missing = []
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        missing.append("chromium (apt-get install chromium)")
    if not shutil.which("chromedriver"):
        missing.append("chromedriver (apt-get install chromium-driver)")
    for mod, pkg in (("selenium", "selenium"), ("jupyterlab", "jupyterlab")):
        if importlib.util.find_spec(mod) is None:
            missing.append(f"{pkg} (pip install {pkg})")
    return missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab_server():
    missing = _missing()
    if missing:
        why = "the browser test needs " + ", ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(why + " (CI must run it: .ci/run installs them)")
        pytest.skip(why)
    tmp = Path(tempfile.mkdtemp(prefix="course-browser-"))
    dest = workspace.create(dest=tmp / "work", quiet=True)
    lab1 = dest / "labs" / "lab1_embedding_kernel.ipynb"
    nb = nbformat.read(lab1, as_version=4)
    solution = {c.get("id"): c.source for c in
                nbformat.read(ROOT / "solutions" / lab1.name, as_version=4).cells}
    for cell in nb.cells:  # the learner did exercise 1 (the naive kernel), not 2 and 3
        if "build_naive_kernel():" in cell.source and "NotImplementedError" in cell.source:
            cell.source = solution[cell.get("id")]
    nbformat.write(nb, lab1)
    crash = nbformat.read(ROOT / "solutions" / lab1.name, as_version=4)  # every answer, one with an off-by-one
    for cell in crash.cells:
        cell.source = cell.source.replace("if i < out.shape[0] * dim:", "if i <= out.shape[0] * dim:")
    nbformat.write(crash, dest / "labs" / "lab1_crash.ipynb")

    port, token = _free_port(), secrets.token_hex(16)
    env = dict(workspace.lab_env(dest), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_CONFIG_DIR=str(tmp / "config"))
    env.pop("MPLBACKEND", None)  # figures go into the notebook, as for a learner
    cmd = workspace.lab_command(dest, port=port, token=token) + [
        "--LabApp.expose_app_in_browser=True", f"--LabApp.workspaces_dir={tmp / 'lab-workspaces'}",
        f"--LabApp.user_settings_dir={tmp / 'lab-settings'}", "--ServerApp.log_level=WARN"]
    base = f"http://127.0.0.1:{port}"
    try:
        with jupyter_lab(cmd, env, dest, tmp / "server.log", base, token):
            yield {"base": base, "token": token, "dest": dest}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(lab_server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never fetch a browser or driver
    opts = webdriver.ChromeOptions()
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(flag)
    # no --user-data-dir: with one, Chromium 150 (Debian bookworm) never focuses the page, so JupyterLab has no
    # current widget and "Run All" runs nothing; chromedriver gives each session a fresh profile of its own
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    opts.binary_location = binary
    driver = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=opts)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


_STATE = """
const app = window.jupyterapp;
const w = app && app.shell.currentWidget;
if (!w || !w.content || !w.sessionContext) return null;
const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
const cells = w.content.widgets.filter(c => c.model.type === 'code').map(c => ({
  count: c.model.executionCount,
  outputs: c.model.outputs.toJSON().map(o => ({type: o.output_type, ename: o.ename || '', evalue: o.evalue || '',
    text: [].concat(o.text || (o.data && o.data['text/plain']) || []).join('')}))}));
return {path: w.context.path, kernel: kernel ? kernel.status : 'none', cells: cells};
"""


def _run_all(driver, lab_server, rel: str) -> dict:
    """Open ``rel`` from the workspace in JupyterLab, Run All, wait until every code cell ran; the final state."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{lab_server['base']}/lab/tree/{rel}?token={lab_server['token']}")
    WebDriverWait(driver, 120).until(EC.presence_of_element_located((By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")))
    WebDriverWait(driver, 120).until(
        lambda d: (s := d.execute_script(_STATE)) and s["path"].endswith(rel) and s["kernel"] == "idle")
    driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")
    deadline, state = time.time() + RUN_TIMEOUT, None
    while time.time() < deadline:
        time.sleep(2)
        state = driver.execute_script(_STATE)
        errors = [o for c in state["cells"] for o in c["outputs"] if o["type"] == "error"]
        if errors or (state["kernel"] == "idle" and all(c["count"] for c in state["cells"])):
            break
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / (Path(rel).stem + ".png")))
    # what the notebook shows (from JupyterLab's model: cells scrolled out of view are not in the DOM)
    state["text"] = "\n".join(o["text"] for c in state["cells"] for o in c["outputs"])
    return state


def _assert_ran_clean(state, rel):
    errors = [f"{o['ename']}: {o['evalue']}" for c in state["cells"] for o in c["outputs"] if o["type"] == "error"]
    assert not errors, f"{rel}: error output in the browser: {errors}"
    not_run = [i for i, c in enumerate(state["cells"]) if not c["count"]]
    assert not not_run, f"{rel}: code cells {not_run} did not run within {RUN_TIMEOUT} s (kernel {state['kernel']})"


def test_notebook_00_runs_in_jupyterlab(browser, lab_server):
    rel = "notebooks/00_start_here.ipynb"
    state = _run_all(browser, lab_server, rel)
    _assert_ran_clean(state, rel)
    assert "Running on" in state["text"], "the header (course.header()) is not visible"
    teacher = browser.execute_script("return window.jupyterapp.listPlugins().filter(p => p.includes('nbgrader'))")
    assert teacher == [], f"nbgrader's plugins (Validate, Create Assignment) are loaded for the learner: {teacher}"


def test_lab1_shows_done_and_not_done_marks(browser, lab_server):
    rel = "labs/lab1_embedding_kernel.ipynb"
    state = _run_all(browser, lab_server, rel)
    _assert_ran_clean(state, rel)
    lines = state["text"].splitlines()
    assert any("✓" in l and "1. naive kernel" in l for l in lines), "exercise 1 is done: expected its ✓"
    for name in ("2. clear errors", "3. fast kernel"):
        assert any(name in l and "not done yet" in l for l in lines), f"expected '{name}: not done yet'"
    assert not [l for l in lines if l.lstrip().startswith("✗ ")], "no check should have failed"


def test_a_crashing_kernel_is_one_cross_and_run_all_reaches_the_end(browser, lab_server):
    rel = "labs/lab1_crash.ipynb"
    state = _run_all(browser, lab_server, rel)
    _assert_ran_clean(state, rel)  # no error output: the crash is reported by the check, and every cell ran
    lines = state["text"].splitlines()
    crosses = [l for l in lines if l.lstrip().startswith("✗ ")]
    assert len(crosses) == 1 and "1. naive kernel: CRASHED (IndexError" in crosses[0], crosses
    assert any("your line" in l for l in lines) and any("hint: [1/" in l for l in lines)
    assert "Traceback" not in state["text"]
    assert any("3. fast kernel" in l and "passed" in l for l in lines), "Run All did not reach exercise 3"


def test_long_result_tables_stay_on_the_page(browser, tmp_path):
    """`course run`'s HTML of a result with a long reason and many columns: the reason wraps, whole, and a table
    wider than the page scrolls inside its own box instead of widening the page."""
    from course.tools import render

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from course.core.reference import load_reference\nload_reference('graph_cache_fallback')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "t.ipynb"
    nbformat.write(nb, path)
    nb, err = render.execute(path, timeout=120)
    assert err is None, err
    body, why = render.to_html(nb)
    assert body, why
    (tmp_path / "t.html").write_text(body, encoding="utf-8")
    browser.set_window_size(900, 900)
    try:
        browser.get((tmp_path / "t.html").as_uri())
        got = browser.execute_script("""
          const cells = [...document.querySelectorAll('.course-result td')];
          const reason = cells.find(c => c.textContent.includes('after replay'));
          const box = document.querySelector('.course-result').getBoundingClientRect();
          const out = document.querySelector('.course-result').closest('.jp-OutputArea-output');
          return {page: document.documentElement.scrollWidth, view: document.documentElement.clientWidth,
                  right: box.right, out: out.clientWidth, out_content: out.scrollWidth, reason: reason.textContent, height: reason.getBoundingClientRect().height,
                  font: parseFloat(getComputedStyle(reason).fontSize)};""")
    finally:
        browser.set_window_size(1400, 1000)
    assert got["page"] <= got["view"] and got["right"] <= got["view"], got
    assert got["out_content"] <= got["out"], f"the table spills out of the cell's output area: {got}"
    assert got["height"] > 3 * got["font"], f"the reason should wrap onto several lines: {got}"
    assert got["reason"].endswith("after replay. (at lookup.py:134)"), got["reason"]
