"""The one error type the user sees as a one-line message (the CLI prints it and exits with code 2).

Every module raises a subclass of ``FlopcountError`` for input the user can fix: a model spec that does not
resolve, an input shape that does not fit, an unknown device, a corrupt profile, a missing optional package.
"""


class FlopcountError(Exception):
    """Bad input or a missing dependency; the message is one line that says what to do."""
