"""How the CLI fails: one line on stderr, `error: STATUS: message`, and an exit code.

Exit codes: 0 ok, 1 the job could not be done (registry unavailable, a check
failed, something unexpected), 2 bad input (the caller must change something).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2

# Statuses that mean "the input is wrong", as the registry answers them; a missing, unknown or
# under-privileged token is the caller's to change too.
BAD_INPUT_STATUSES = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "OUT_OF_RANGE",
                                "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "PERMISSION_DENIED"})


class CliError(Exception):
    def __init__(self, code: str, message: str, exit_code: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.exit_code = exit_code if exit_code is not None else (
            EXIT_BAD_INPUT if code in BAD_INPUT_STATUSES else EXIT_FAILURE)


def exit_code_of(status: str) -> int:
    return EXIT_BAD_INPUT if status in BAD_INPUT_STATUSES else EXIT_FAILURE


def one_line(text: str) -> str:
    return " ".join(str(text).split())
