"""A fault campaign, after Jepsen: random operations from many worker processes, a nemesis that
injects faults on a schedule drawn from a seed, a complete history, and a checker that judges
the history and the database's rows against what sqllocker promises.

``python -m tests.campaign --backend sqlite --seconds 60 --seed 7`` runs one (see
``campaign.py``); ``tests/test_campaign.py`` runs short ones, and shows the checker catching
deliberately broken libraries (``mutants.py``).

Modules, one job each: ``plan`` (settings, lockstrings, what the seed decides), ``history``
(the event log), ``database`` (the run's own database and tables), ``guarded`` (the write done
under each lock), ``sections`` (what a holder does), ``worker`` and ``async_worker`` (the
clients), ``command`` (the program ``sqllocker run`` runs), ``mutants`` (broken libraries, for
the checker's own tests), ``nemesis`` (the faults), ``checker`` (the judgement), ``report``
(what is printed), ``processes`` (how its processes are forked from servers that imported them
once), ``campaign`` (runs it all).
"""
