"""Step 3, costs: what each node and collective costs. The analytic and torch models and the
cluster (:mod:`scheduler.costs.models`), measured collective tables
(:mod:`scheduler.costs.tables`), compute times from a profile (:mod:`scheduler.costs.profiles`),
measuring them on a process group (:mod:`scheduler.costs.measure`), and the family judged when no
model is given (:mod:`scheduler.costs.family`)."""
