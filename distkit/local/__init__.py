"""Local ranks: processes on this machine that form a process group.

- :mod:`distkit.local.pool`: :class:`RankPool`, a persistent pool of rank processes
  that runs a function on every rank (the test suite's harness, and the engine of
  :func:`distkit.launch`).
- :mod:`distkit.local.worker`: the loop each rank process runs.
- :mod:`distkit.local.launch`: :func:`distkit.launch`, a function on N fresh ranks.
- :mod:`distkit.local.script`: ``distkit launch -n N script.py``, a script on N ranks.
- :mod:`distkit.local.hygiene`: the process-wide state a task may leave behind.
"""
