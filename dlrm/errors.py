"""The error every part of ``dlrm`` raises for a user's mistake or a bad file."""


class RunError(Exception):
    """A user error (bad data, checkpoint, configuration or output): one clear line that
    names the file, option or field, raised before anything was changed."""


class Stopped(Exception):
    """A run or an evaluation was stopped by a signal (its name is the message)."""
