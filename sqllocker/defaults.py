"""The defaults of a Locker's and a purge's options, shared by the front ends and the CLI."""

DEFAULT_EXPIRES = 3600.0
DEFAULT_GRACE = 1.0
DEFAULT_PURGE_BATCH = 5000
# A purge rests this many times each batch's duration after it, so that lock operations beside
# it keep their usual latency while a large backlog still goes in minutes (CHANGELOG.md,
# Performance changes).
DEFAULT_PURGE_PAUSE_RATIO = 6.0
