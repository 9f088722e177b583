"""What watches every collective: debug mode, the default check, the watchdog, and the
errors that name ranks and call sites.

- :mod:`~distkit.dist.guard.watch`: what runs around every backend call;
- :mod:`~distkit.dist.guard.debugmode`: a call's signature, and debug mode's exchange;
- :mod:`~distkit.dist.guard.check`: the default cross-rank check;
- :mod:`~distkit.dist.guard.board`: the world's store as a side channel;
- :mod:`~distkit.dist.guard.watchdog`: the thread that answers for its rank;
- :mod:`~distkit.dist.guard.diagnose`: timeouts and ranks that went away, named.
"""
