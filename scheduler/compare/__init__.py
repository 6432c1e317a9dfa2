"""fsdp-sched against the schedulers it replaces, on the graphs they write.

What ``fsdp-sched demo`` (:mod:`scheduler.cli.demo`) and the benchmarks run:

- :mod:`scheduler.compare.baselines`: torch's overlap scheduler and its manual per-block plan
  as baselines, runnable without a GPU, and torch's memory estimator;
- :mod:`scheduler.compare.judged`: baselines and fsdp-sched written back on copies of a graph and
  judged on the written graphs under several cost models;
- :mod:`scheduler.compare.equal_memory`: the headline, fsdp-sched at each baseline's peak
  against it.
"""
