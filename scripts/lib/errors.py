"""The one error the tooling raises on purpose."""


class ForkError(Exception):
    """An error the user can act on: printed without a traceback."""
