"""The one exception the settings package raises for bad input."""


class ConfigError(ValueError):
    """A settings file or override that cannot be used; the message is meant for the user
    as is: it names the source (file or override), the dotted key, the value and what is
    allowed."""
