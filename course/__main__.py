"""``python -m course``: the command line (:mod:`course.tools.cli`)."""
import sys

from course.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
