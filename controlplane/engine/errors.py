"""Errors the engine raises. All are ValueError subclasses so callers can map them to 4xx."""

from controlplane.errors import FieldError


class ModelLoadError(ValueError):
    """A model directory cannot be loaded: names the file and, where relevant, the tensor."""


# A setting or sampling parameter out of range, naming the field and the limit: the engine's
# name (its public API) for the one field error the whole daemon shares; the same class.
InvalidSettingError = FieldError


class GrammarFailedError(InvalidSettingError):
    """A request's grammar gave up part-way through its output (a parser limit first reached
    deep inside the schema): that request's fault, named by the field its constraint came from."""
