"""Step 2, export: an FX graph -> a cost-annotated networkx DAG (:mod:`scheduler.export.dag`):
what each attribute means (:mod:`scheduler.export.schema`), how ops are read (:mod:`scheduler.export.ops`),
data-dependent sizes (:mod:`scheduler.export.shapes`), which parameter belongs to which repeated
block and direction (:mod:`scheduler.export.structure`), and the JSON file, checked field by
field when read (:mod:`scheduler.export.dagfile`)."""
