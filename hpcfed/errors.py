"""Errors a user can fix, and the exit codes they map to.

`ValueError` is the project's user-error type (bad config, bad data, corrupt file); subclasses
name the area. The CLI prints them as one line without a traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, unknown or malformed; the message names the key."""


class FederationError(RuntimeError):
    """The federation cannot go on (a rank failed, timed out, or was cut off); the message names the rank."""


USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FederationError)
