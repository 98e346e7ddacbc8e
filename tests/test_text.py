"""Reasons in tables: shortened at a sentence's end, torch's "Found from :" never dangling, long cells wrap."""
import json
import re
from pathlib import Path

import pytest

from course.core import text
from course.core.reference import load_reference
from course.core.results import Result

ROOT = Path(__file__).resolve().parent.parent
TORCH_SKIP = ('skipping cudagraphs due to mutated inputs (1 instances). Found from : \n'
              '   File "/home/someone/src/course/lessons/reduce_overhead.py", line 44, in forward\n'
              '    x.clamp_(-3.0, 3.0)  # an in-place update of an input\n')
HINT = ("CUDAGraph supports dynamic shapes by recording a new graph for each distinct input size. Recording too many "
        "CUDAGraphs may lead to extra overhead. We have observed 9 distinct sizes. Please consider the following "
        "options for better performance: a) padding inputs to a few fixed number of shapes; or b) set "
        "torch._inductor.config.triton.cudagraph_skip_dynamic_graphs=True.")


def _recorded(name: str, column: str, contains: str) -> str:
    """A text cell as `course bench` recorded it (the raw JSON, not a display of it)."""
    rows = json.loads((ROOT / "course" / "reference" / f"{name}.json").read_text())["rows"]
    return next(r[column] for r in rows if contains in r[column])


def test_clip_keeps_whole_sentences_and_marks_the_cut():
    assert text.clip("short.", 100) == "short."
    out = text.clip(HINT, 160)
    assert out == ("CUDAGraph supports dynamic shapes by recording a new graph for each distinct input size. Recording "
                   "too many CUDAGraphs may lead to extra overhead. …")
    assert len(out) <= 162
    words = text.clip("one two three four five six seven eight nine ten eleven twelve", 30)
    assert words.endswith(" …") and all(w in "one two three four five six seven eight nine ten eleven twelve".split()
                                        for w in words[:-2].split()), words
    assert text.clip("a, b, c, d, e, f, g, h, i, j, k, l, m, n, o", 20).endswith(" …")


def test_condense_joins_found_from_to_its_location_or_drops_it():
    one = text.condense(TORCH_SKIP, 1)
    assert one == ("skipping cudagraphs due to mutated inputs (1 instances). Found from reduce_overhead.py, line 44, "
                   "in forward: x.clamp_(-3.0, 3.0) # an in-place update of an input")
    assert "/home/someone" not in text.condense(TORCH_SKIP) and "Found from :" not in text.condense(TORCH_SKIP)
    bare = text.condense("skipping cudagraphs due to mutated inputs (2 instances). Found from : \n", 1)
    assert bare == "skipping cudagraphs due to mutated inputs (2 instances)."
    assert text.condense("a\n\nb\nc", 2) == "a / b"
    assert text.location("/x/y/f.py", 3) == "Found from f.py, line 3"


def test_condense_of_a_torch_log_never_leaves_a_dangling_found_from():
    for lines in (1, 2, 4):
        out = text.condense(TORCH_SKIP, lines)
        assert not re.search(r"Found from\s*:\s*($|/|\|)", out), out
        assert "reduce_overhead.py, line 44" in out


@pytest.mark.parametrize("name,column,contains,want", [
    ("graph_cache_step", "skip_reason", "Found from", "skipping cudagraphs due to mutated inputs (2 instances)."),
    ("compile_skip_reasons", "skip_reason", "Found from",
     "skipping cudagraphs due to mutated inputs (1 instances). Found from reduce_overhead.py, line 44, in forward: "
     "x.clamp_(-3.0, 3.0)  # an in-place update of an input"),
    ("graph_cache_trace", "note", "CUDAGraph supports",
     "CUDAGraph supports dynamic shapes by recording a new graph for each distinct input size. Recording too many "
     "CUDAGraphs may lead to extra overhead. …"),
])
def test_tidy_mends_the_recorded_reasons(name, column, contains, want):
    raw = _recorded(name, column, contains)
    assert raw != want, "the recorded text changed: re-read it"
    assert text.tidy(raw) == want


def test_tidy_drops_a_quoted_half_statement():
    raw = _recorded("graph_cache_fallback", "reason", "bounds='host'")
    assert raw.endswith('which cannot be ")'), "the recorded text changed: re-read it"
    assert text.tidy(raw).endswith("after replay. (at lookup.py:134)")
    assert text.tidy("E: x (at f.py:3: x.item())") == "E: x (at f.py:3: x.item())"
    assert text.complete_statement("x.item()") and not text.complete_statement('raise E("a "')


def test_tidy_leaves_whole_texts_alone():
    """Every other recorded text cell is shown as recorded (a fixed-length cut is only guessed at known lengths)."""
    changed = {("graph_cache_step", "skip_reason"), ("compile_skip_reasons", "skip_reason"),
               ("graph_cache_trace", "note"), ("graph_cache_fallback", "reason"), ("capture_recovery", "failure"),
               ("real_model_decode", "log")}
    for path in sorted((ROOT / "course" / "reference").glob("*.json")):
        for row in json.loads(path.read_text())["rows"]:
            for col, v in row.items():
                if isinstance(v, str) and (path.stem, col) not in changed:
                    assert text.tidy(v) == v, (path.stem, col, v)
    assert not text.looks_cut("AcceleratorError: CUDA error: operation not permitted when stream is capturing")
    assert text.looks_cut("RuntimeError: " + "x" * 159 + "p")


def test_no_recorded_reason_is_shown_cut_or_dangling():
    """What notebook 04 (and every other) shows for the recorded results: no "Found from :" left hanging,
    no text that stops inside a word or a quoted statement."""
    for path in sorted((ROOT / "course" / "reference").glob("*.json")):
        res = load_reference(path.stem)
        html = str(res.html())
        assert not re.search(r"Found from\s*:\s*(<|\||/)", html), path.stem
        for row in res.rows:
            for v in row.values():
                if isinstance(v, str) and v:
                    shown = text.tidy(v)
                    assert not text.looks_cut(shown) and not shown.endswith('")'), (path.stem, shown)


def test_result_html_wraps_long_text_cells():
    long = "a reason " * 30
    r = Result("t", "T", {"name_with_parts": "", "us": "us", "why": ""}, [{"name_with_parts": "x", "us": 1.5,
                                                                            "why": long.strip()}])
    html = str(r.html())
    assert "overflow-x:auto" in html.split("<table")[0], "a wide table scrolls inside its box, not the page"
    cells = re.findall(r"<td style='([^']*)'>([^<]*)</td>", html)
    styles = {v: s for s, v in cells}
    assert "white-space:normal" in styles[long.strip()] and "overflow-wrap:break-word" in styles[long.strip()]
    assert "min-width" in styles[long.strip()] and "min-width" not in styles["x"], "only long text gets room"
    assert "nowrap" in styles["1.5"] and long.strip() in html, "text is shown whole"
    assert "name_<wbr>with_<wbr>parts" in html
    assert "Found from :" not in Result("t", "T", {"r": ""}, [{"r": "x. Found from : "}]).table()


def test_graph_cache_reasons_name_a_whole_line():
    from course.lessons.graph_cache.backends import diagnose
    frames = [("/u/lookup.py", 134, "f", 'raise RuntimeError("the first line of a longer "')]
    assert diagnose("RuntimeError", "m", frames) == "RuntimeError: m (at lookup.py:134)"
    frames = [("/u/decoder.py", 42, "f", "x.item()")]
    assert diagnose("RuntimeError", "m", frames) == "RuntimeError: m (at decoder.py:42: x.item())"
