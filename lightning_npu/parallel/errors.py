"""The layout errors: raised before any process group exists, each naming the argument, the value and the fix."""


class ParallelConfigError(ValueError):
    """A parallel layout argument is invalid; the message names the argument and the fix."""


class NotImplementedYetError(NotImplementedError):
    """A contract argument whose feature has not landed yet (never silently ignored)."""


class CompressionConfigError(ValueError):
    """A `gradient_compression` value is invalid; the message names it and the fix."""
