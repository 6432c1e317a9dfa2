"""How the pass runs inside a training job: the torch.compile backend and inductor pass
(:mod:`scheduler.integrate.compile`; what they tell of FSDP2 models, whose collectives are not
in compiled graphs: :mod:`scheduler.integrate.fsdp2`), the pass for torchtitan's graph trainer
(:mod:`scheduler.integrate.graph_trainer`), the ranks' agreement on one schedule
(:mod:`scheduler.integrate.consensus`) and the schedule cache (:mod:`scheduler.integrate.cache`)."""
