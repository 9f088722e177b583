"""The lowest floor of distkit.dist: what every other layer passes around or checks.

- :mod:`~distkit.dist.core.comm`: :class:`Comm`, a resolved group (the value), and what
  distkit learns about each process group;
- :mod:`~distkit.dist.core.args`: argument checks, reduction ops, the error layout;
- :mod:`~distkit.dist.core.spec`: one spec per collective, from which the tables of
  the other layers are derived;
- :mod:`~distkit.dist.core.layouts`: every binary layout that travels between ranks,
  and the dtype codes;
- :mod:`~distkit.dist.core.shortcut`: the compiled single-process shortcuts.

Nothing here imports another layer of distkit.dist.
"""
