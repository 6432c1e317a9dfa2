"""Step 3, costs: what each node and collective costs. The machine (:mod:`scheduler.costs.hardware`),
the cost models (:mod:`scheduler.costs.models`: analytic, measured tables, profiles; torch's
estimators in :mod:`scheduler.costs.torch_model`), what a user's ``cost_model`` names
(:mod:`scheduler.costs.spec`), costs put on an exported DAG (:mod:`scheduler.costs.annotate`),
measured collective tables (:mod:`scheduler.costs.tables`), compute times from a profile
(:mod:`scheduler.costs.profiles`), measuring them on a process group (:mod:`scheduler.costs.measure`),
and the family judged when no model is given (:mod:`scheduler.costs.family`)."""
