"""Rounds of one measurement per source tree, interleaved: what the ab_*.py scripts share.

One run of a benchmark on this kind of machine moves by more than most changes are worth, so a
change is judged against the code before it in alternating rounds: each round runs every tree's
measurement (a fresh interpreter, in that tree's directory, so it imports that tree's code),
reversing the order of the trees every other round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any


def trees_of(parser: argparse.ArgumentParser, given: list[str]) -> list[tuple[str, str]]:
    """``name=path`` arguments as (name, path) pairs; two or more, or a usage error."""
    if len(given) < 2 or not all("=" in tree for tree in given):
        parser.error("give two or more trees, each as name=path")
    return [(name, path) for name, path in (tree.split("=", 1) for tree in given)]


def run_rounds(
    trees: list[tuple[str, str]], rounds: int, program: str, *arguments: str
) -> dict[str, list[dict[str, Any]]]:
    """Run ``python -c program arguments...`` in each tree, ``rounds`` times, interleaved; each
    run's last line of output is its JSON figures. Prints each round's figures as it comes."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for number in range(rounds):
        for name, path in trees if number % 2 == 0 else trees[::-1]:
            done = subprocess.run(
                [sys.executable, "-c", program, *arguments],
                cwd=path,
                capture_output=True,
                text=True,
                check=False,
            )
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                print(number, name, done.stderr[-2000:], flush=True)
                continue
            results[name].append(json.loads(lines[-1]))
            print(number, name, lines[-1], flush=True)
    return results


def print_medians(results: dict[str, list[dict[str, Any]]]) -> None:
    for name, measured in results.items():
        if measured:
            medians = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
            print(name, "median", json.dumps(medians))
