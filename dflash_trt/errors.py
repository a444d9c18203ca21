# SPDX-License-Identifier: Apache-2.0
"""Error hierarchy. Every user-facing failure is one line: what, which value, and the fix.

Exit codes: 2 for usage errors (bad flags, incompatible inputs), 1 for runtime failures,
3 when the environment lacks something optional (no GPU, no TensorRT-LLM).
"""

from __future__ import annotations

from typing import Any


class DFlashTrtError(Exception):
    """Base class. `hint` is the fix, printed after the message."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = self.message.rstrip(".")
        if self.hint:
            text += f"; fix: {self.hint}"
        return text.replace("\n", " ")

    def __str__(self) -> str:
        return self.one_line()

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword fields (hint, field, value, output) survive pickling: the engine process sends its
        # errors to the server's process (api/process.py) as they are.
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(cls: type[DFlashTrtError], args: tuple[Any, ...], state: dict[str, Any]) -> DFlashTrtError:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class UsageError(DFlashTrtError):
    """Bad input from the user (flags, files, incompatible model pair). Exit code 2."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration field has a bad value. Names the field and the value."""

    def __init__(self, field: str, value: Any, problem: str, *, hint: str | None = None) -> None:
        self.field = field
        self.value = value
        super().__init__(f"{field}={value!r}: {problem}", hint=hint)


class IncompatiblePairError(ConfigError):
    """Drafter and target do not fit together."""


class CheckpointError(UsageError):
    """Missing, unreadable or corrupt checkpoint files."""


class EnvironmentMissing(DFlashTrtError):
    """An optional dependency or device is not available. Exit code 3."""

    exit_code = 3


class RequestError(UsageError, ValueError):
    """A single request has bad parameters; the engine keeps serving others. A ValueError too, as
    TensorRT-LLM's LLM API raises for a bad request, so a server catches one type for both engines.
    `field` names the request field at fault (`max_tokens`, `prompt`, `temperature`, ...), when one
    is: the fronts report it as such (the OpenAI front's `param`), never by searching the message."""

    def __init__(self, message: str, *, field: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.field = field


class EngineDeadError(DFlashTrtError, RuntimeError):
    """The engine stopped before the request completed: its thread raised, wedged, or the LLM was
    shut down. The message names the cause; `output` holds what the request had produced by then."""

    def __init__(self, message: str, *, hint: str | None = None, output: Any = None) -> None:
        super().__init__(message, hint=hint)
        self.output = output
