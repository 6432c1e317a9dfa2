"""Offline what-if tools: pictures of schedules and trade-offs (:mod:`scheduler.whatif.plots`) and
hand-built or synthetic FSDP DAGs to try them on (:mod:`scheduler.whatif.synthetic`)."""
