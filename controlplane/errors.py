"""The one error shape for a wrong value, shared by the config, the reports, the engine and both
APIs: the field it is about and what is allowed. The APIs answer it as a 400 (or 422) whose
`param` is the field; the CLI prints it as one line. Torch-free and import-free: everything
may import it, the engine included."""

from __future__ import annotations


class FieldError(ValueError):
    """`field` is wrong: `message` says what is allowed (and, where useful, what was given)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        # Both halves kept: callers re-home the field (a prompt index, an "engine." prefix) or
        # answer with the message alone, without parsing str(exc) back apart.
        self.field, self.message = field, message
