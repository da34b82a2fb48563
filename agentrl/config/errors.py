"""The one error type for config mistakes, in a module of its own: code below the config loader (model resolution,
trackers) raises it without importing the loader."""


class ConfigError(ValueError):
    """A config mistake, already phrased for the user (key path + what is allowed)."""
