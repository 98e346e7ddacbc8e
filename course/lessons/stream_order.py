"""The stream-order reader's old address: it is :mod:`course.core.stream_order` now."""
from course.core.stream_order import FORK, JOIN, StreamOrder  # noqa: F401

__all__ = ["FORK", "JOIN", "StreamOrder"]
