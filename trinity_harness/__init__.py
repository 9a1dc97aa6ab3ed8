"""Development tooling shared by the tests and the benchmarks; not part of trinity_train, which
never imports it (tests/test_layering.py).

- `ranks`: functions run on N spawned gloo ranks of this machine (`run_ranks`, `RankPool`);
- `cluster_bed`: the cluster bed of network-namespace hosts (`launch/cluster.sh`) and SLURM on it;
- `jobs`: the job runner: training jobs launched as a user launches them (`launch/local.sh`,
  `launch/multinode.sh` on the bed's hosts), their records, the machine's load and counters;
- `instruments`: what a training rank runs to measure itself (the collective counter, the
  collective waits by site), installed by `train_instrumented`, the trainer's entry for a job
  launched with `TRAIN_MODULE=trinity_harness.train_instrumented`;
- `plan_runs`, `synthetic_run`, `corpus`: measured training runs for the plan's checks, run directories
  written by hand for the dashboard, a tiny prepared corpus.

Installed beside trinity_train by `pip install -e .` (pyproject.toml); its paths to the launchers
(`launch/`) are the repository's, so only an editable install or a checkout on PYTHONPATH works.
"""
