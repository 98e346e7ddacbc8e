"""Text for tables and reasons: shortened at a sentence's end, torch's log messages condensed, never
cut mid-sentence.

- :func:`clip`: at most about ``limit`` characters, ending at a sentence (or clause) end, with "…"
  when shortened;
- :func:`condense`: a multi-line log message in a few lines, joined with " / ", machine paths cut to
  file names, torch's "Found from :" joined to the location it introduces (or dropped when none
  follows);
- :func:`tidy`: what a table shows for a text cell recorded before these rules: no dangling "Found
  from :", no quoted half statement, and a text cut at a fixed length ends at its last full
  sentence, marked "…".
"""
from __future__ import annotations

import re

ELLIPSIS = " …"
_SENTENCE_END = re.compile(r"[.!?](?=\s)|[.!?]$")
_CLAUSE_END = re.compile(r"[;:,](?=\s)| [|/] | - ")
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][^\s/\\:\"']+)+[/\\]([^\s/\\:\"']+)")
_FOUND = re.compile(r"\s*Found from\s*:\s*$")
_FILE = re.compile(r'^File "([^"]+)", line (\d+)(?:, in (\S+))?$')
_FOUND_JOINED = re.compile(r'Found from\s*:\s*/\s*File "([^"]+)", line (\d+)(?:, in ([^\s/|]+))?(?:\s*/\s*([^/|]*?))?'
                           r'\s*(?=$| \| | / )')
_FOUND_EMPTY = re.compile(r"\s*Found from\s*:\s*(\||$)")
_AT_CODE = re.compile(r" \(at ([^\s():]+:\d+): (.*)\)$")
# the lengths the course's producers once cut reasons at (``[:N]`` after an "Error: " prefix, or the
# whole text); shorter cuts are not guessed at: too many whole messages are that short
CUT_LENGTHS = (150, 160, 200, 240, 300, 400)


def clip(text: str, limit: int = 200) -> str:
    """``text`` if it fits in ``limit`` characters, else its full sentences that fit, then " …".

    With no sentence end in reach, it ends at the last clause end (";", ":", ",", " | ") or word,
    still marked " …": a cut is always visible and never falls inside a word.
    """
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    head = text[:limit + 1]
    for pattern in (_SENTENCE_END, _CLAUSE_END):
        ends = [m.end() for m in pattern.finditer(head) if m.end() >= limit // 3]
        if ends:
            return text[:ends[-1]].rstrip(" ,;:|/-") + ELLIPSIS
    cut = head.rfind(" ")
    return (text[:cut] if cut > limit // 3 else text[:limit]).rstrip(" ,;:|/-") + ELLIPSIS


def location(file: str, line, func: str | None = None, code: str = "") -> str:
    """'Found from reduce_overhead.py, line 44, in forward: x.clamp_(...)': where torch says a
    hazard is."""
    name = _PATH.sub(r"\1", file)
    where = f"Found from {name}, line {line}" + (f", in {func}" if func else "")
    return where + (f": {code.strip()}" if code and code.strip() else "")


def condense(message: str, lines: int = 4, limit: int = 400) -> str:
    """The first ``lines`` non-empty lines of a log message joined with " / ", clipped to ``limit``;
    machine paths cut to file names, torch's "Found from :" joined with its location or dropped."""
    raw = [l.strip() for l in str(message).strip().splitlines() if l.strip()]
    kept, i = [], 0
    while i < len(raw):
        line = raw[i]
        if _FOUND.search(line):
            m = _FILE.match(raw[i + 1]) if i + 1 < len(raw) else None
            if m:
                code = raw[i + 2] if i + 2 < len(raw) and not _FILE.match(raw[i + 2]) else ""
                line = _FOUND.sub("", line) + " " + location(m.group(1), m.group(2), m.group(3), code)
                i += 2 if code else 1
            else:
                line = _FOUND.sub("", line)
        kept.append(_PATH.sub(r"\1", line))
        i += 1
    return clip(" / ".join(l for l in kept[:lines] if l), limit)


def complete_statement(code: str) -> bool:
    """True when ``code`` is whole Python (a source line that is not the first line of a longer
    statement)."""
    try:
        compile(code, "<code>", "exec")
        return True
    except SyntaxError:
        return False


def looks_cut(text: str) -> bool:
    """True for a text cut at one of the producers' old fixed lengths (:data:`CUT_LENGTHS`) in
    mid-sentence."""
    body = text.split(": ", 1)[1] if re.match(r"^[A-Za-z_.]+(Error|Exception|Warning): ", text) else text
    return (len(body) in CUT_LENGTHS or len(text) in CUT_LENGTHS) and text[-1:].isalnum()


def tidy(text: str) -> str:
    """A text cell as a table shows it: torch's "Found from :" joined with its location (or dropped),
    a half-quoted statement after a location cut, a text cut mid-sentence (:func:`looks_cut`) ended at
    its last full sentence with " …"; anything else as it is."""
    if not isinstance(text, str) or not text:
        return text
    out = _FOUND_JOINED.sub(lambda m: location(m.group(1), m.group(2), m.group(3), m.group(4) or ""), text)
    out = _FOUND_EMPTY.sub(lambda m: " |" if m.group(1) else "", out).rstrip()
    at = _AT_CODE.search(out)
    if at and not complete_statement(at.group(2)):
        out = out[:at.start()] + f" (at {at.group(1)})"
    if looks_cut(text):
        ends = [m.end() for m in _SENTENCE_END.finditer(out)]
        cut = ends[-1] if ends else out.rfind(" ")
        out = (out[:cut] if cut > 0 else out).rstrip(" ,;:|/-") + ELLIPSIS
    return out
