"""The one exception type for mistakes a user can make (config, data path, layout, checkpoint).

The command line prints its message as a single line and exits with status 2, without a
traceback. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input; the message names the value and the fix."""
