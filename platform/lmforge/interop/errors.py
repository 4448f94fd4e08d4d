"""The one error of the Hugging Face mapping, export and import: what cannot be mapped, named, with the fix."""


class InteropError(ValueError):
    """An architecture, config field or tensor that cannot be mapped; the message names it and says what to do."""
