"""The norm-placement study (`trinity-train ablate`): run a grid of training cells that differ only
in model.block, train.seed and the learning rates, on the same batches, and report what each
measured (docs/CONTRACT.md "Study").

spec.py reads the study file; cells.py resolves each cell's config and the study's hash;
layout.py names the output directory's files; runner.py runs the cells in subprocesses and
state.py records how each ended; measure.py reads one cell's run directory; aggregate.py, table.py,
plots.py and report.py write the report; command.py is the CLI command.
"""
