"""Exceptions that end a command with one readable paragraph instead of a traceback."""

# Exit codes shared by the CLI, the Makefile and the tests.
EXIT_CONFIG = 2
EXIT_DATA_UNAVAILABLE = 3
EXIT_FAILED = 1
EXIT_LOCKED = 4  # another process is writing to the run directory
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on a signal after a checkpoint; re-run to resume
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), after a checkpoint; re-run to resume


class BnexpError(Exception):
    """A problem the user can fix; its message is printed as is."""

    exit_code = EXIT_FAILED
    in_run_log = True  # also written to the run's train.log (not when the directory is another run's)

    def __init__(self, message: str) -> None:
        super().__init__(_from_worker(message, type(self)))


def _from_worker(message: str, cls: type) -> str:
    """The original message of an error a DataLoader worker raised.

    torch re-raises a worker's exception in the main process as ``cls(text)``, where the
    text is "Caught <name> in DataLoader worker process <n>" followed by the worker's whole
    traceback; its last line, "<module>.<name>: <message>", holds the message itself.
    """
    if not message.startswith(f"Caught {cls.__name__} in DataLoader worker process"):
        return message
    _, found, original = message.rpartition(f"\n{cls.__module__}.{cls.__qualname__}: ")
    return original.rstrip("\n") if found else message


class ConfigError(BnexpError):
    """An impossible or unknown configuration value."""

    exit_code = EXIT_CONFIG


class OtherRunThere(ConfigError):
    """The run directory holds a run of other settings: nothing is written there."""

    in_run_log = False


class DataError(BnexpError):
    """Data on disk that cannot be read (corrupt, truncated, wrong layout)."""

    exit_code = EXIT_CONFIG


class DataUnavailable(BnexpError):
    """The data set is not on disk and could not be downloaded."""

    exit_code = EXIT_DATA_UNAVAILABLE


def unknown_choice(kind: str, value: object, choices) -> ConfigError:
    """The standard error for a name that is not one of the valid choices."""
    listed = ", ".join(sorted(str(c) for c in choices))
    return ConfigError(f"unknown {kind} {value!r}; valid choices: {listed}")
