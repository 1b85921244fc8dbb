"""Small domain exceptions. The CLI maps each to a one-line red message and an exit code."""


class SpecmlxError(Exception):
    """Base class: a problem the user can fix, reported without a traceback."""

    exit_code = 1


class BadInput(SpecmlxError):
    """Invalid arguments or input text (exit code 2)."""

    exit_code = 2


class UnknownModel(SpecmlxError):
    """An alias or path that names no model we can load."""

    exit_code = 2


class RegistryError(SpecmlxError):
    """models.toml is malformed: the message names the file, line and key."""

    exit_code = 2


class ModelLoadError(SpecmlxError):
    """Weights are missing, corrupt, or of an unsupported kind."""


class IncompatiblePair(SpecmlxError):
    """Target and draft do not share a tokenizer closely enough to speculate."""

    exit_code = 2


class RollbackError(SpecmlxError):
    """A cache cannot give tokens back exactly; stopping beats emitting a wrong token."""


class DoesNotFit(SpecmlxError):
    """The models and their KV caches do not fit in the memory the device can use."""


class OfflineError(SpecmlxError):
    """A model is not in the local cache and the network (or hub) is unavailable."""


def parsed(value, kind: type, name: str):
    """``value``, checked to be a ``kind`` (TypeError otherwise): each setting is parsed once,
    at its edge (the CLI, an HTTP body, models.toml, the bench's options), into the typed value
    the code inside takes (choosers.K, tree_size.TreeSize); nothing inside reads text again.

    value: the setting; kind: its type; name: the field, for the message."""
    if not isinstance(value, kind):
        raise TypeError(
            f"{name} must be a {kind.__name__}, parsed at its edge ({kind.__name__}.of), "
            f"got {value!r}"
        )
    return value
