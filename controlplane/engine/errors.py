"""Errors the engine raises. All are ValueError subclasses so callers can map them to 4xx."""


class ModelLoadError(ValueError):
    """A model directory cannot be loaded: names the file and, where relevant, the tensor."""


class InvalidSettingError(ValueError):
    """A setting or sampling parameter is out of range: names the field and the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        # Both halves kept: callers re-home the field (a prompt index, "engine." prefix) or
        # answer with the message alone, without parsing str(exc) back apart.
        self.field, self.message = field, message


class GrammarFailedError(InvalidSettingError):
    """A request's grammar gave up part-way through its output (a parser limit first reached
    deep inside the schema): that request's fault, named by the field its constraint came from."""
