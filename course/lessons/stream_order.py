"""Where the stream-order reader used to live: it is :mod:`course.core.stream_order` now (lessons 02 and 06 and lab 2
use it); its public names stay importable from here."""
from course.core.stream_order import FORK, JOIN, StreamOrder  # noqa: F401

__all__ = ["FORK", "JOIN", "StreamOrder"]
