"""The one exception the entry point turns into a single error line and a non-zero exit."""


class UserError(Exception):
    """Bad input from the user: a config value, a file, a device. The message is the whole story."""
