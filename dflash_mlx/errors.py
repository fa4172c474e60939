"""The errors a checkpoint or a conversion raises (a leaf: the named models and the command line
name them without importing the loaders, and so MLX)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or does not fit."""


class ConversionError(CheckpointError):
    """A conversion that cannot produce a correct output; the message says what to do."""
