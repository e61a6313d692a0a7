"""The one exception type for mistakes a user can fix.

Entry points catch :class:`ClpError`, print its message and exit non-zero;
anything else is a bug and keeps its traceback.
"""


class ClpError(Exception):
    """A user-facing error: bad input, a missing file, mismatched heads."""
