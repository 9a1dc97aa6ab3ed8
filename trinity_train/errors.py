"""User-caused errors. The CLI prints their message as one line and exits with `exit_code`
(`exit_codes`: 2 for a mistake in the command itself, a config key or value or an argument that
names the wrong kind of path; 1 for what a right command reads or writes: a missing, damaged or
incompatible checkpoint or dataset, a full disk; 3 for a diverged run, `stability.guard`)."""

from trinity_train import exit_codes


class UserError(Exception):
    """A mistake the user can fix (bad config, missing data, incompatible checkpoint)."""

    exit_code = exit_codes.FAILURE


class ConfigError(UserError, ValueError):
    """Bad configuration: the message names the key and what was expected."""

    exit_code = exit_codes.CONFIG


class ArgumentError(UserError):
    """A command-line argument no run can make right: an output path that is a file, exists or
    cannot be created, a RUN_DIR that is not a run directory, a port out of range."""

    exit_code = exit_codes.CONFIG


class DataError(UserError):
    """Missing, malformed or inconsistent data."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or incompatible with the run."""
