"""``python -m course``: the command line (:mod:`course.tools.cli`)."""
import sys
from pathlib import Path


def _missing_dependency(e: ModuleNotFoundError) -> int:
    """A clear message instead of a traceback when this Python lacks the course's dependencies."""
    root = Path(__file__).resolve().parents[1]
    print(f"python -m course: this Python ({sys.executable}) "
          f"cannot import {e.name!r}, which the course needs.",
          file=sys.stderr)
    if (root / ".venv" / "bin" / "python").exists():
        print("The course is installed in .venv/: run `source .venv/bin/activate` first "
              "(or use the make targets, or .venv/bin/python -m course ...).", file=sys.stderr)
    else:
        print("Set the course up first: `make setup` (then `source .venv/bin/activate`), or "
              "`pip install -e .[test,lab]` into this Python.", file=sys.stderr)
    return 3


if __name__ == "__main__":
    try:
        from course.tools.cli import main
        code = main()
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("course",):
            raise
        code = _missing_dependency(e)
    sys.exit(code)
