"""trinity_harness/instruments.py names each collective wait of a training step by where it waits
(`multinode.py --where` reads its table): on two gloo ranks of FSDP x EP, a forward, backward and
Muon step wait in the FSDP all-gathers and reduce-scatters (the embedding's row exchanges under their
own names), the EP all-to-alls of both passes and Muon's exchange, and nothing is left unnamed."""

from __future__ import annotations

import torch

from conftest import TINY_MODEL, benchmark_module


def _one_step_by_site() -> dict:
    import torch.distributed as dist

    from trinity_harness.ranks import init_gloo
    from trinity_train.config import load_config
    from trinity_train.optim.groups import build_optimizer
    from trinity_train.parallel.gloo.communication import install_gloo_communication
    from trinity_train.parallel.mesh import ParallelDims
    from trinity_train.parallel.parallelize import build_parallel_model

    from trinity_harness.instruments import WaitSites

    init_gloo()
    cfg = load_config(None, {"model": dict(TINY_MODEL), "parallel": {"ep": 2}})
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    dims.build_mesh("cpu")
    model = build_parallel_model(cfg, dims, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.optim)
    communication = install_gloo_communication(model, optimizer, dims, torch.device("cpu"))
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    with WaitSites() as sites:
        communication.before_backward(fresh=True)
        model(ids, labels=ids).ce_sum.backward()
        communication.after_backward()
        optimizer.step()
    return {site: count for site, (count, _) in sites.waits.items()}


def test_every_wait_of_a_step_is_named_by_its_site(rank_pool):
    for rank, counts in enumerate(rank_pool(2).run(_one_step_by_site)):
        assert "other" not in counts, (rank, counts)
        for named in ("FSDP all-gather, root", "FSDP all-gather, embedding rows", "FSDP all-gather, layers.1",
                      "FSDP reduce-scatter", "FSDP reduce-scatter, embedding rows", "EP all-to-all, forward",
                      "EP all-to-all, backward", "Muon exchange"):
            assert counts.get(named, 0) > 0, (rank, named, counts)


def test_the_benchmark_reads_each_ranks_measured_iterations_only(tmp_path, monkeypatch):
    """`instruments.rank_iterations`: the tables of iterations first..last, in order, per rank; the
    collective counter's "setup" and "between" entries are not iterations."""
    import json

    from trinity_harness.instruments import rank_iterations

    for rank in (0, 1):
        table = {"setup": {"x": -1}, "1": {"x": rank}, "2": {"x": 2 + rank}, "between": {"x": -2}, "3": {"x": 3}}
        (tmp_path / f"waits{rank}.json").write_text(json.dumps(table))
    assert rank_iterations(tmp_path, "waits", 2, 3) == [[{"x": 2}, {"x": 3}], [{"x": 3}, {"x": 3}]]


def test_the_where_table_says_what_each_shaped_link_adds(monkeypatch):
    """`multinode.report_where`: per site, each rank's seconds under every condition, and what
    1 Gbit/s and 200 Mbit/s each add over one host (the mean of the ranks), the sites ordered by
    the slower link's addition; the totals add the sites."""
    from trinity_harness.instruments import ITERATION_WALL

    multinode = benchmark_module("multinode")

    def row(name: str, ep: tuple[float, float], muon: tuple[float, float], wall: float) -> dict:
        return {"condition": name, "steps": 16, "load_start": "0.5", "load_end": "1.0",
                "waits": [{"EP": e, "Muon": m, ITERATION_WALL: wall} for e, m in zip(ep, muon)]}

    rows = [row("a", (0.01, 0.03), (0.00, 0.02), 0.8), row("c", (0.03, 0.05), (0.01, 0.01), 0.9),
            row("d", (0.05, 0.07), (0.50, 0.30), 2.0), row("c, no overlap", (0.1, 0.1), (0.1, 0.1), 1.2)]
    lines = multinode.report_where(rows)
    assert lines[1].split(" | ")[1:6] == ["a", "c", "added by 1 Gbit/s (mean of the ranks)", "d", "added by 200 Mbit/s"]
    muon, ep = lines[3], lines[4]  # Muon gains more at 200 Mbit/s (+0.39) than EP (+0.04): first
    assert muon == "| Muon | 0.000 / 0.020 | 0.010 / 0.010 | +0.000 | 0.500 / 0.300 | +0.390 | 0.100 / 0.100 |"
    assert ep == "| EP | 0.010 / 0.030 | 0.030 / 0.050 | +0.020 | 0.050 / 0.070 | +0.040 | 0.100 / 0.100 |"
    assert lines[5].startswith("| all sites (sum of the medians, mean of the ranks) | 0.030 | 0.050 | +0.020 | 0.460 | +0.430 |")
    assert lines[6] == "| the iteration | 0.800 | 0.900 | +0.100 | 2.000 | +1.200 | 1.200 |"
