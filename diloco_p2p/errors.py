"""The one exception type for a user's mistake.

A `UserError` carries one line that names the thing that is wrong and how to fix it. The CLI
prints it as ``error: <line>`` and exits with code 2, without a traceback. Bugs and faults
of our own raise ordinary exceptions; network faults during a round are data, not errors.
"""


class UserError(Exception):
    """A mistake the user can fix: bad config, bad address, corrupt or mismatched checkpoint."""

    exit_code = 2
