"""User-caused errors. The CLI prints their message as one line and exits with `exit_code`
(`exit_codes`: 2 configuration, 1 otherwise; 3 for a diverged run, `stability.guard`)."""

from trinity_train import exit_codes


class UserError(Exception):
    """A mistake the user can fix (bad config, missing data, incompatible checkpoint)."""

    exit_code = exit_codes.FAILURE


class ConfigError(UserError, ValueError):
    """Bad configuration: the message names the key and what was expected."""

    exit_code = exit_codes.CONFIG


class DataError(UserError):
    """Missing, malformed or inconsistent data."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or incompatible with the run."""
