"""The one error every configuration check raises, in a module of its own so that the config
modules built on `rayinfer.config` (config_v4) and the kernels' own checks can raise it without
importing the model config."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the valid values."""
