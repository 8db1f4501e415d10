"""The one error type the CLI maps to exit codes and `error: ... / hint: ...` lines."""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_RUNNING = 3


class PdserveError(Exception):
    def __init__(self, message: str, hint: str | None = None, exit_code: int = EXIT_ERROR):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code


class ConfigError(PdserveError):
    """Bad cluster.yaml: always exit 2, raised before any process starts."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint, EXIT_BAD_INPUT)


class NotRunningError(PdserveError):
    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint, EXIT_NOT_RUNNING)


class UsageError(PdserveError):
    """A bad command-line argument (an unknown process, an ambiguous name): exit 2."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint, EXIT_BAD_INPUT)
