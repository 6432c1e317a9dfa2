"""Step 2, export: an FX graph -> a cost-annotated networkx DAG (:mod:`scheduler.export.dag`),
its file format checked field by field (:mod:`scheduler.export.schema`), and which parameter
belongs to which repeated block and direction (:mod:`scheduler.export.structure`)."""
