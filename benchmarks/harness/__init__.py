"""The evaluation harness: how fsdp-sched is compared with the baselines.

It is not part of the installed library (``scheduler``, ``solvers``, ``models``): the library
schedules a user's graph; the harness measures it against other schedulers, and the scripts
under ``benchmarks/`` run it (with ``benchmarks/`` on ``sys.path``, ``import harness``).

- :mod:`harness.baselines`: torch's overlap scheduler as a baseline, runnable without a GPU, and
  torch's memory estimator;
- :mod:`harness.judged`: baselines and fsdp-sched written back on copies of a graph and judged
  on the written graphs under several cost models;
- :mod:`harness.equal_memory`: the headline, fsdp-sched at each baseline's peak against it.
"""
