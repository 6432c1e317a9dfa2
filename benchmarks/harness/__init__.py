"""The evaluation harness's own pieces, outside the library (``scheduler``, ``solvers``, ``models``).

How fsdp-sched is compared with the baselines (torch's schedulers, the heuristics, at equal
memory, on the written graphs) is in the library, :mod:`scheduler.compare`, so that
``fsdp-sched demo`` runs from an installed package. What stays here serves the benchmarks only
(with ``benchmarks/`` on ``sys.path``, ``import harness``):

- :mod:`harness.repros`: other people's graphs, autoparallel's published FSDP repros and their
  collective tables, read from a folder the user fetched.
- :mod:`harness.output`: how a benchmark ends (its tables, its wall time, its JSON rows).
"""
