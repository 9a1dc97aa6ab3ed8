"""User-caused errors. The CLI prints their message as one line and exits with `exit_code`."""


class UserError(Exception):
    """A mistake the user can fix (bad config, missing data, incompatible checkpoint)."""

    exit_code = 1


class ConfigError(UserError, ValueError):
    """Bad configuration: the message names the key and what was expected."""

    exit_code = 2


class DataError(UserError):
    """Missing, malformed or inconsistent data."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or incompatible with the run."""
