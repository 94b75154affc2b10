"""The ``sqllocker`` command line as a worker's ``run`` operation starts it: with the campaign's
mutant applied first, if one is named (see ``mutants.py``)."""

from tests.campaign import mutants

mutants.apply()

from sqllocker.cli import main  # noqa: E402

main()
