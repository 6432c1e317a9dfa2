"""How the pass runs inside a training job: the torch.compile backend and inductor pass
(:mod:`scheduler.integrate.compile`), the ranks' agreement on one schedule
(:mod:`scheduler.integrate.consensus`) and the schedule cache (:mod:`scheduler.integrate.cache`)."""
