"""The learner's workspace: copies of the lessons and labs in a git-ignored folder, opened by `make lab`."""
import json
import os
import re
import secrets
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

from cellrun import jupyter_lab
from course.tools import catalog, workspace
from course.tools.cli import build_parser, main
from course.tools.learner_versions import build_labs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def shipped_copy(tmp_path):
    """A copy of the shipped course (notebooks, labs, solutions, .gitignore) in its own git repository."""
    if shutil.which("git") is None:
        pytest.skip("needs git (to see what a learner's work leaves in `git status`)")
    root = tmp_path / "course"
    for d in ("notebooks", "labs", "solutions"):
        shutil.copytree(ROOT / d, root / d)
    shutil.copy(ROOT / ".gitignore", root / ".gitignore")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(git + ["-C", str(root), "add", "-A"], check=True)
    subprocess.run(git + ["-C", str(root), "commit", "-qm", "shipped"], check=True)
    return root


def _has_outputs(path: Path) -> list:
    nb = json.loads(path.read_text())
    return [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]


def test_workspace_copies_lessons_and_labs_not_solutions(shipped_copy):
    dest = workspace.create(root=shipped_copy, quiet=True)
    assert dest == workspace.workspace_dir(shipped_copy) == shipped_copy / "work"
    copied = sorted(str(p.relative_to(dest)) for p in dest.rglob("*.ipynb"))
    assert copied == sorted(workspace.shipped(shipped_copy))
    assert any(c.startswith("notebooks/") for c in copied) and any(c.startswith("labs/") for c in copied)
    assert not any(c.startswith("solutions/") for c in copied)


def test_workspace_keeps_the_learners_copies_and_resets_on_request(shipped_copy):
    dest = workspace.create(root=shipped_copy, quiet=True)
    mine = dest / "labs" / "lab1_embedding_kernel.ipynb"
    mine.write_text(mine.read_text().replace("YOUR CODE HERE", "my answer"))
    workspace.create(root=shipped_copy, quiet=True)
    assert "my answer" in mine.read_text()
    workspace.create(root=shipped_copy, reset=["lab1_embedding_kernel.ipynb"], quiet=True)
    assert "my answer" not in mine.read_text()
    with pytest.raises(ValueError, match="not a lesson or lab"):
        workspace.create(root=shipped_copy, reset=["nope.ipynb"], quiet=True)


def test_lab_command_is_headless_on_the_workspace(tmp_path, monkeypatch):
    cmd = workspace.lab_command(tmp_path, port=9999, token="abc")
    assert f"--ServerApp.root_dir={tmp_path}" in cmd and "--no-browser" in cmd and "--port=9999" in cmd
    assert "--IdentityProvider.token=abc" in cmd
    monkeypatch.setattr(workspace, "is_root", lambda: True)
    assert "--allow-root" in workspace.lab_command(tmp_path)
    monkeypatch.setattr(workspace, "is_root", lambda: False)
    assert "--allow-root" not in workspace.lab_command(tmp_path)


def test_learners_lab_turns_nbgrader_off(tmp_path, monkeypatch):
    """nbgrader is the teacher's tool: its Validate button, Create Assignment sidebar and warnings stay out."""
    server, lab = workspace.teacher_extensions()
    assert set(workspace.NBGRADER_SERVER) <= set(server) and "@jupyter/nbgrader" in lab
    cmd = workspace.lab_command(tmp_path)
    for name in workspace.NBGRADER_SERVER:
        assert f"--ServerApp.jpserver_extensions={name}=False" in cmd
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", "/elsewhere")
    env = workspace.lab_env(tmp_path)
    cfg = tmp_path / workspace.CONFIG
    assert workspace.learner_config_dir(tmp_path) == cfg
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(cfg), "/elsewhere"], "ours must come first"
    page = json.loads((cfg / "labconfig" / "page_config.json").read_text())
    assert page["disabledExtensions"] == {n: True for n in [*lab, workspace.ANNOUNCEMENTS]}
    srv = json.loads((cfg / "jupyter_server_config.json").read_text())
    assert srv["ServerApp"]["jpserver_extensions"] == {n: False for n in server}
    assert srv["LabApp"] == {"news_url": None}, "no news feed fetched for the learner"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_learners_jupyterlab_serves_no_nbgrader(tmp_path):
    """Start the learner's JupyterLab headless and ask it: nbgrader's pages are gone, its lab extension disabled."""
    pytest.importorskip("jupyterlab")

    dest = tmp_path / "work"
    dest.mkdir()
    port, token = _free_port(), secrets.token_hex(8)
    env = workspace.lab_env(dest)
    env.update(JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "user-config"))
    base = f"http://127.0.0.1:{port}"

    def get(url):
        try:
            with urllib.request.urlopen(f"{base}{url}?token={token}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""

    with jupyter_lab(workspace.lab_command(dest, port=port, token=token), env, dest, tmp_path / "server.log", base,
                     token, limit=90):
        for url in ("/formgrader", "/courses", "/assignments", "/assignments/validate"):
            assert get(url)[0] == 404, f"nbgrader's {url} is served in the learner's JupyterLab"
        status, page = get("/lab")
        assert status == 200
        data = json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                                    page, re.S).group(1))
        assert "@jupyter/nbgrader" in data["disabledExtensions"], data["disabledExtensions"]
        # JupyterLab 4.6 asks "get notified about official Jupyter news?" from this plugin: it is off
        assert workspace.ANNOUNCEMENTS in data["disabledExtensions"], data["disabledExtensions"]
        assert data["news"] == {"disabled": True}, data.get("news")
        status, body = get("/lab/api/extensions")
        if status == 200:  # the extension manager's view agrees
            listed = {e["name"]: e["enabled"] for e in json.loads(body)}
            assert not any(on for name, on in listed.items() if "nbgrader" in name), listed
    assert "nbgrader_config.py" not in (tmp_path / "server.log").read_text()


def _children(pid: int) -> list:
    """The pids of the live children of ``pid`` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_sigterm_stops_jupyterlab_too(tmp_path, signame):
    """`python -m course workspace --lab` stopped with SIGTERM (or Ctrl-C's SIGINT) stops jupyter-lab and waits for
    it: no child is left."""
    pytest.importorskip("jupyterlab")
    if not Path("/proc/self/task").is_dir():
        pytest.skip("reads the process tree from /proc (Linux)")
    import signal
    import sys
    import time
    import urllib.error
    import urllib.request

    port = _free_port()
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "user-config"), PYTHONPATH=str(ROOT))
    with open(tmp_path / "lab.log", "w") as log:
        parent = subprocess.Popen([sys.executable, "-m", "course", "workspace", "--lab", "--dir", str(tmp_path / "w"),
                                   "--port", str(port)], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline, lab, found = time.time() + 90, [], []
            while not lab:
                lab = _children(parent.pid)
                found[:] = lab
                up = False
                if lab:
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5).close()
                        up = True
                    except urllib.error.HTTPError:  # 403 without the token: it is up
                        up = True
                    except OSError:
                        pass
                if not up:
                    lab = []
                    assert parent.poll() is None and time.time() < deadline, \
                        f"JupyterLab did not start: {(tmp_path / 'lab.log').read_text()[-2000:]}"
                    time.sleep(0.3)
            parent.send_signal(getattr(signal, signame))
            assert parent.wait(timeout=60) == 0
            end = time.time() + 10
            while any(_alive(p) for p in lab) and time.time() < end:
                time.sleep(0.2)
            assert not [p for p in lab if _alive(p)], f"jupyter-lab {lab} still runs after its parent stopped"
        finally:
            if parent.poll() is None:
                parent.kill()
            for p in found:  # never leave a server behind, even when the test fails
                if _alive(p):
                    os.kill(p, signal.SIGKILL)
    assert (tmp_path / "w" / "notebooks" / "00_start_here.ipynb").exists(), "--dir is where the workspace goes"


def test_serve_waits_for_its_child_and_returns_its_code(tmp_path):
    import sys
    assert workspace.serve([sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_serve_kills_a_child_that_will_not_stop(tmp_path):
    """A child that ignores SIGTERM is killed `timeout` seconds after the signal: serve never hangs nor leaves it."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("reads the process tree from /proc (Linux)")
    import signal
    import sys
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
               "time.sleep(120)"
    code = f"import sys; from course.tools.workspace import serve; sys.exit(serve([sys.executable, '-c', {stubborn!r}], " \
           "timeout=1))"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert parent.stdout.readline().strip() == "up"
        (child,) = _children(parent.pid)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 0
        assert not _alive(child), "the child that ignored SIGTERM still runs"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_learners_copy_says_it_is_theirs(tmp_path):
    """The contributors' note (a change goes into solutions/..., then regenerate) stays out of the learner's copy."""
    from course.tools.learner_versions import source_note
    dest = workspace.create(dest=tmp_path / "work", quiet=True)
    for rel in workspace.shipped():
        first = nbformat.read(dest / rel, as_version=4).cells[0]
        assert first.cell_type == "markdown" and "regenerate" not in first.source, rel
        assert first.source.rstrip().endswith(workspace.your_copy_note(rel)), rel
        assert f"python -m course check work/{rel}" in first.source
    rel = "labs/lab1_embedding_kernel.ipynb"
    assert source_note("solutions/lab1_embedding_kernel.ipynb") in (ROOT / rel).read_text(), "shipped: unchanged"
    bare = tmp_path / "bare.ipynb"  # a notebook that starts with code gets the note as a first cell
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]), bare)
    workspace.make_yours(bare, "notebooks/bare.ipynb")
    assert nbformat.read(bare, as_version=4).cells[0].source == workspace.your_copy_note("notebooks/bare.ipynb")


def test_cli_workspace(monkeypatch, tmp_path):
    args = build_parser().parse_args(["workspace", "--lab", "--port", "9000", "--dir", "elsewhere"])
    assert args.lab and args.port == 9000 and args.dir == "elsewhere"
    monkeypatch.setattr(workspace, "ROOT", tmp_path)
    monkeypatch.setattr(workspace, "workspace_dir", lambda root=tmp_path: tmp_path / "work")
    monkeypatch.setattr(workspace, "shipped", lambda root=tmp_path: [])
    assert main(["workspace"]) == 0
    assert main(["workspace", "--reset", "nope"]) == 2
    assert workspace.main.__doc__


def test_make_lab_opens_the_workspace_not_the_shipped_files():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nlab:")[1].split("\n\n")[0]
    assert "course workspace --lab" in recipe, f"`make lab` must open the learner's workspace: {recipe!r}"
    assert "work/" in (ROOT / ".gitignore").read_text().split()


def test_learner_work_leaves_the_shipped_course_clean(shipped_copy):
    """Issue 8, observation 6: a learner opens notebook 00 in JupyterLab (autosave keeps outputs) and fills in
    lab 1. On the old setup (`jupyter lab --notebook-dir=.`) that edited the shipped files and `make test` failed
    ('has outputs', 'labs out of sync'). With the workspace, those edits land in git-ignored copies."""
    dest = workspace.create(root=shipped_copy, quiet=True)
    served = Path(next(a for a in workspace.lab_command(dest) if a.startswith("--ServerApp.root_dir="))
                  .split("=", 1)[1])
    # what JupyterLab's autosave writes after the learner ran notebook 00 ...
    nb00 = served / "notebooks" / "00_start_here.ipynb"
    nb = nbformat.read(nb00, as_version=4)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]
        cell.execution_count = i + 1
    nbformat.write(nb, nb00)
    # ... and after they filled in lab 1 with their own code (here: the solution's)
    lab1 = served / "labs" / "lab1_embedding_kernel.ipynb"
    lab = nbformat.read(lab1, as_version=4)
    sol = nbformat.read(shipped_copy / "solutions" / "lab1_embedding_kernel.ipynb", as_version=4)
    by_id = {c.get("id"): c.source for c in sol.cells}
    lab.cells = [nbformat.from_dict(dict(c, source=by_id.get(c.get("id"), c.source))) for c in lab.cells]
    nbformat.write(lab, lab1)
    assert _has_outputs(nb00) and "NotImplementedError" not in lab1.read_text()

    # the maintainer tests on the shipped course: no outputs, labs in sync, nothing to commit
    for path in catalog.all_notebooks_on_disk(shipped_copy):
        assert not _has_outputs(path), f"{path.relative_to(shipped_copy)} has outputs"
    assert build_labs(check=True, root=shipped_copy) == 0, "labs out of sync"
    status = subprocess.run(["git", "-C", str(shipped_copy), "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout == "", f"the learner's work shows up in git: {status.stdout}"


def test_course_check_works_on_a_workspace_copy(tmp_path, capsys):
    """`python -m course check` runs the learner's copy (in its own folder) and reports it."""
    from course.tools.grade import check_notebook
    dest = workspace.create(dest=tmp_path / "work", quiet=True)
    assert check_notebook(dest / "notebooks" / "00_start_here.ipynb", timeout=300) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "work") in out and "no exercise checks" in out


def test_readme_starts_where_a_learner_starts():
    """The README's first screen says what to run and what to open; its course map lists the learner's copies."""
    import re
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_screen = "\n".join(readme.splitlines()[:30])
    assert "## Start learning" in first_screen and "make lab" in first_screen, "the first screen: what to run"
    assert "notebooks/00_start_here.ipynb" in first_screen, "the first screen: what to open"
    order = [readme.index(h) for h in ("## Start learning", "## Course map", "## Two commands", "## GPU or no GPU")]
    assert order == sorted(order), "start learning, the map, then the commands of CI and the GPU lane"
    course_map = readme[readme.index("## Course map"):readme.index("## Who it is for")]
    rows = re.findall(r"^\| [^|]+ \| `([^`]+)` \|", course_map, re.M)
    in_order = [e.path for e in catalog.CATALOG if e.kind in workspace.KINDS]
    assert rows == [f"{workspace.WORKDIR}/{rel}" for rel in in_order], \
        "the course map lists every lesson and lab, in the course's order, as the learner's copy in work/"
