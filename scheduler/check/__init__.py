"""Step 5, check on the written graph: memory counts of an FX graph (:mod:`scheduler.check.judge`)
and the schedule written back, judged and installed (:mod:`scheduler.check.written`). The
execution model itself (simulator, evaluator, validator) is torch-free, in :mod:`solvers.core`."""
