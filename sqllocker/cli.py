"""Placeholder replaced in the CLI step."""


def main() -> None:
    pass
