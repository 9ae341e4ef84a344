"""The one exception every cancellable long operation raises, so callers catch a single type."""


class Cancelled(Exception):
    """A long operation (tokenizing, prefill, generation) stopped: its cancel event was set."""
