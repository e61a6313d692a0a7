"""The one exception type for mistakes a user can fix.

The API raises :class:`ClpError` for bad input (prompts, options, model and
heads folders); commands print its message as one line ``error: ...`` and
exit 1 (``cli/args.guarded``, which also turns a file that cannot be read or
written and text that is not UTF-8 into such a line). Anything else is a bug
and keeps its traceback; ``--debug`` shows the traceback of any error.
"""


class ClpError(Exception):
    """A user-facing error: bad input, a missing file, mismatched heads."""
