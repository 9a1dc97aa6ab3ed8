"""Hardware profiles (plan/profile.py) and `trinity-train plan --hardware PROFILE`: the curves a
profile prices collectives with, its JSON file and the one-line refusals of a file that is not one
or describes other hardware, and a CPU job's plan priced on a synthetic gloo profile whose rates are
known (compute = the model's FLOPs over the measured step rate, each traced call by its curve, the
no-overlap step predicted). `trinity-train calibrate`, which writes profiles, is
tests/test_calibrate.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_one_line_error, run_cli
from trinity_train import exit_codes
from trinity_train.errors import ConfigError
from trinity_train.plan.hardware import DEFAULT_MFU, GPUS
from trinity_train.plan.profile import (FORMAT, KINDS, SEND, VERSION, Curve, HardwareProfile, ProfiledHardware, as_hardware,
                                        load_profile, profile_record, wire_kind)
from trinity_train.plan.timing import StepTime

NODE = "n0"
MATMUL_FLOPS, PEAK_FLOPS, GROUPED_FLOPS, STEP_FLOPS = 2e10, 3e10, 1.5e10, 1e10
MEMORY = 8 * 2 ** 30
# The job every priced plan here is of: the default model on 2 ranks of one node, EP 2 (the
# experts' all-to-alls, FSDP's all-gathers and gloo's reduce-scatter as all-to-alls, Muon's
# redistribution, a few small all-reduces).
JOB = ("--world", "2", "--parallel.ep=2", "--train.micro_batch_size=4", "--train.global_batch_size=8")
# A linear curve through the origin per kind (bytes a rank sends per second), all different: a call
# of any size then takes its bytes over its kind's rate, so the step's communication is each traced
# row's bytes over its kind's rate.
BANDWIDTH = {"all_gather": 1e8, "reduce_scatter": 3e8, "all_reduce": 4e8, "all_to_all": 5e7}


def linear_curves(kinds=KINDS) -> dict:
    return {("inside", k): Curve(((1.0, 1.0 / BANDWIDTH[k]), (1e9, 1e9 / BANDWIDTH[k]))) for k in kinds}


def two_point_curves() -> dict:
    """Two measured sizes per kind with a latency: a call's time is not proportional to its bytes,
    so pricing a row's calls as one call of their total would give another number."""
    return {("inside", k): Curve(((1e4, (i + 1) * 1e-3), (1e7, (i + 1) * 5e-2))) for i, k in enumerate(KINDS)}


def a_profile(path: Path, **fields) -> HardwareProfile:
    """A gloo profile of one node of two ranks with the rates above (`fields` replace any)."""
    base = dict(path=str(path), torch=torch.__version__, backend="gloo", device="cpu", dtype="float32",
                nodes={NODE: [0, 1]}, memory_bytes=MEMORY, matmul_flops=MATMUL_FLOPS, peak_flops=PEAK_FLOPS,
                grouped_flops=GROUPED_FLOPS, step_flops=STEP_FLOPS, curves=linear_curves())
    return HardwareProfile(**{**base, **fields})


def written(profile: HardwareProfile) -> Path:
    """The profile's file, as calibrate writes it."""
    path = Path(profile.path)
    path.write_text(json.dumps(profile_record(profile), indent=1) + "\n")
    return path


def record_with(tmp_path: Path, change) -> Path:
    """A valid profile's record after `change(record)` (a damaged file)."""
    record = profile_record(a_profile(tmp_path / "p.json"))
    change(record)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(record))
    return path


def cli(capsys, *args) -> tuple[int, str, str]:
    """`trinity-train ARGS` in this process: (exit code, stdout, stderr)."""
    from trinity_train import cli as console

    code = console.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def plan_json(capsys, *args) -> dict:
    code, out, err = cli(capsys, "plan", *args, "--json")
    assert code == exit_codes.DONE, err[-3000:]
    return json.loads(out)


# ---------------------------------------------------------------------------- curves


def test_a_call_between_two_measured_sizes_takes_the_line_between_them():
    curve = Curve(((1e3, 1e-3), (1e5, 2e-3), (1e6, 1e-2)))
    assert [curve.seconds(s) for s in (1e3, 1e5, 1e6)] == [1e-3, 2e-3, 1e-2]  # the measurements themselves
    assert curve.seconds(50_500) == pytest.approx(1.5e-3)  # half way from 1e3 to 1e5
    assert curve.seconds(550_000) == pytest.approx(6e-3)  # half way from 1e5 to 1e6
    assert curve.seconds(325_000) == pytest.approx(2e-3 + 8e-3 / 4)  # a quarter of the way


def test_below_the_smallest_size_latency_above_the_largest_its_bandwidth():
    curve = Curve(((1e3, 1e-3), (1e6, 1e-2)))
    assert curve.seconds(1) == curve.seconds(999) == 1e-3  # latency-bound: no faster than the smallest call
    assert curve.bandwidth == pytest.approx(1e8)
    assert curve.seconds(4e6) == pytest.approx(4e6 / 1e8)  # the largest size's bytes per second
    one = Curve(((1e4, 2e-3),))
    assert one.seconds(10) == 2e-3 and one.seconds(3e4) == pytest.approx(6e-3)


def test_a_too_slow_size_and_all_larger_ones_cannot_be_priced():
    curve = Curve(((1e3, 1e-3), (1e5, 2e-3)), too_slow=(4e5, 0.25))
    assert curve.seconds(399_999) == pytest.approx(2e-3 * 3.99999)
    assert curve.seconds(4e5) is None and curve.seconds(1e9) is None
    nothing = Curve((), too_slow=(16384.0, 0.1))  # the smallest size already too slow
    assert nothing.seconds(1) is None and nothing.bandwidth == 0.0


def test_a_call_the_profile_cannot_price_is_one_line_naming_the_link(tmp_path):
    curves = {("inside", "all_to_all"): Curve(((1e4, 1e-3),), too_slow=(4e4, 0.5))}
    profile = a_profile(tmp_path / "p.json", curves=curves)
    assert profile.call_seconds("all_to_all", "inside", 1e4) == 1e-3
    with pytest.raises(ConfigError, match=r"the link inside a node was too slow to measure a all-to-all of 0\.04 MB "
                                          r"within 0\.5 s, and this plan sends 0\.05 MB a call: calibrate again"):
        profile.call_seconds("all_to_all", "inside", 5e4)
    with pytest.raises(ConfigError, match="no all-gather across nodes .*one node: calibrate on at least two nodes"):
        profile.call_seconds("all_gather", "across", 1e4)
    with pytest.raises(ConfigError, match="no all-reduce inside a node .*one rank per node"):
        profile.call_seconds("all_reduce", "inside", 1e4)


def test_gloo_runs_fsdp_reduce_scatters_and_embedding_rows_as_all_to_alls():
    for category in ("FSDP reduce-scatter", "FSDP reduce-scatter, embedding rows", "FSDP all-gather, embedding rows"):
        assert wire_kind(category, "reduce_scatter", "gloo") == "all_to_all"
        assert wire_kind(category, "reduce_scatter", "nccl") == "reduce_scatter"
    assert wire_kind("FSDP all-gather", "all_gather", "gloo") == "all_gather"
    assert wire_kind("EP all-to-all", "all_to_all", "nccl") == "all_to_all"
    assert wire_kind("x", "broadcast", "nccl") == "all_gather" and wire_kind("x", "send", "gloo") == SEND


def test_a_profile_prices_a_flow_call_by_call_and_a_datasheet_by_bytes(tmp_path):
    profile = a_profile(tmp_path / "p.json", curves=two_point_curves())
    hw = as_hardware(profile)
    ag = profile.curves[("inside", "all_gather")]
    # 3 calls of 1e6 bytes: three times one call of 1e6, not one call of 3e6 (the latency counts 3 times).
    assert hw.flow_seconds("FSDP all-gather", "all_gather", True, 3e6, 3) == pytest.approx(3 * ag.seconds(1e6))
    assert hw.flow_seconds("FSDP all-gather", "all_gather", True, 3e6, 3) != pytest.approx(ag.seconds(3e6))
    a2a = profile.curves[("inside", "all_to_all")]
    assert hw.flow_seconds("FSDP reduce-scatter", "reduce_scatter", True, 2e6, 2) == pytest.approx(2 * a2a.seconds(1e6))
    assert hw.flow_seconds("FSDP all-gather", "all_gather", True, 0.0, 0) == 0.0
    assert not hw.overlaps_communication and hw.memory_bytes == MEMORY and hw.peak_tflops == MATMUL_FLOPS / 1e12
    assert profile.mfu == STEP_FLOPS / MATMUL_FLOPS
    h100 = GPUS["h100"]
    assert h100.overlaps_communication and not isinstance(h100, ProfiledHardware)
    assert h100.flow_seconds("EP all-to-all", "all_to_all", True, 9e9, 7) == 9e9 / h100.intra_bytes_s
    assert h100.flow_seconds("EP all-to-all", "all_to_all", False, 9e9, 7) == 9e9 / h100.inter_bytes_s


def test_the_predicted_step_is_the_bound_the_backend_overlaps_to():
    nccl = StepTime(compute_s=2.0, comm_s=1.5, intra_bytes=0, inter_bytes=0, tokens_per_gpu=100, overlaps=True)
    gloo = StepTime(compute_s=2.0, comm_s=1.5, intra_bytes=0, inter_bytes=0, tokens_per_gpu=100, overlaps=False)
    assert nccl.predicted_s == nccl.overlap_s == 2.0 and gloo.predicted_s == gloo.no_overlap_s == 3.5
    exposed = StepTime(compute_s=2.0, comm_s=1.5, intra_bytes=0, inter_bytes=0, tokens_per_gpu=100, exposed_s=1.0)
    assert exposed.predicted_s == 3.0  # max(2, 0.5) + the exposed second
    assert nccl.rank_key == (2.0, 3.5) and gloo.rank_key == (3.5, 2.0)


# ---------------------------------------------------------------------------- the file


def test_a_profile_survives_its_json_file(tmp_path):
    curves = {**two_point_curves(),
              ("across", "all_gather"): Curve(((16384.0, 0.01), (65536.0, 0.02)), too_slow=(262144.0, 0.125)),
              ("across", "all_to_all"): Curve((), too_slow=(16384.0, 0.05)),
              ("across", SEND): Curve(((16384.0, 0.01), (2 ** 26, 0.5)))}
    profile = a_profile(tmp_path / "p.json", nodes={"a": [0, 1], "b": [2, 3]}, curves=curves, config="c.toml",
                        seconds=12.5, time_limit_s=20.0)
    loaded = load_profile(written(profile))
    assert loaded == profile
    assert loaded.ranks_per_node == 2 and loaded.name == "profile p.json"
    assert loaded.link_bandwidth("across") == pytest.approx(2 ** 26 / 0.5)  # one way, the largest send
    record = json.loads((tmp_path / "p.json").read_text())
    assert record["format"] == FORMAT and record["version"] == VERSION
    assert record["links"]["across"]["all_gather"]["too_slow"] == {"bytes": 262144.0, "seconds_allowed": 0.125}
    dense = a_profile(tmp_path / "dense.json", grouped_flops=None)  # a model without routed experts
    assert load_profile(written(dense)).grouped_flops is None


def test_points_are_read_smallest_first(tmp_path):
    def shuffle(record):
        record["links"]["inside"]["all_gather"]["points"].reverse()

    curve = load_profile(record_with(tmp_path, shuffle)).curves[("inside", "all_gather")]
    assert [s for s, _ in curve.points] == [1.0, 1e9]


def _set(path: tuple, value):
    def change(record):
        node = record
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


def _drop(*path):
    def change(record):
        node = record
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return change


DAMAGED = {
    "memory not a number": (_set(("memory_bytes",), "lots"), ["a damaged hardware profile", "ValueError"]),
    "no compute": (_drop("compute"), ["a damaged hardware profile", "KeyError"]),
    "no step rate": (_drop("compute", "step_flops"), ["a damaged hardware profile", "step_flops"]),
    "links a list": (_set(("links",), []), ["a damaged hardware profile"]),
    "unknown collective": (_set(("links", "inside", "broadcast"), {"points": [], "too_slow": None}),
                           ["unknown link class or collective inside/broadcast"]),
    "unknown link class": (_set(("links", "far"), {"all_gather": {"points": [], "too_slow": None}}),
                           ["unknown link class or collective far/all_gather"]),
    "negative seconds": (_set(("links", "inside", "all_gather", "points"), [{"bytes": 1e4, "seconds": -1.0}]),
                         ["inside/all_gather: sizes and seconds must be finite numbers > 0"]),
    "zero step rate": (_set(("compute", "step_flops"), 0.0), ["rates, memory and nodes must be", "positive"]),
    "no nodes": (_set(("nodes",), {}), ["rates, memory and nodes must be", "positive"]),
    "nodes a list": (_set(("nodes",), ["n0"]), ["a damaged hardware profile"]),
    "NaN matmul rate": (_set(("compute", "matmul_flops"), float("nan")),
                        ["rates, memory and nodes must be", "positive"]),
}


@pytest.mark.parametrize("write,fragments", [
    pytest.param(lambda p: None, ["no such file", "trinity-train calibrate --out"], id="missing"),
    pytest.param(lambda p: p.write_text("{not json"), ["is not a readable JSON hardware profile"], id="not JSON"),
    pytest.param(lambda p: p.write_bytes(b"\xff\xfe\x00"), ["is not a readable JSON hardware profile"], id="binary"),
    pytest.param(lambda p: p.write_text("[1, 2]"), ["is not a hardware profile", FORMAT], id="a list"),
    pytest.param(lambda p: p.write_text(json.dumps({"format": "something else", "version": 1})),
                 ["is not a hardware profile", "trinity-train calibrate"], id="wrong format"),
    pytest.param(lambda p: p.write_text(json.dumps({"format": FORMAT, "version": VERSION + 1})),
                 [f"a profile of version {VERSION + 1}", f"reads version {VERSION}", "calibrate again"],
                 id="wrong version"),
])
def test_a_file_that_is_not_a_profile_is_one_line(capsys, tmp_path, write, fragments):
    path = tmp_path / "profile.json"
    write(path)
    code, out, err = cli(capsys, "plan", "--cpu", "--hardware", path)
    assert_one_line_error(code, err, exit_codes.CONFIG, f"--hardware '{path}'", *fragments)
    assert out == ""


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_profile_is_one_line(capsys, tmp_path, damage):
    change, fragments = DAMAGED[damage]
    path = record_with(tmp_path, change)
    code, out, err = cli(capsys, "plan", "--cpu", "--hardware", path)
    assert_one_line_error(code, err, exit_codes.CONFIG, f"--hardware '{path}'", "calibrate again", *fragments)


@pytest.mark.slow  # console-script processes (~5 s each on a busy 2-core machine)
def test_a_bad_profile_through_the_console_script(tmp_path):
    missing = tmp_path / "none.json"
    done = run_cli("plan", "--cpu", "--hardware", missing)
    assert_one_line_error(done.returncode, done.stderr, exit_codes.CONFIG, f"--hardware '{missing}': no such file")
    damaged = record_with(tmp_path, _set(("memory_bytes",), "lots"))
    done = run_cli("plan", "--hardware", damaged, *JOB)
    assert_one_line_error(done.returncode, done.stderr, exit_codes.CONFIG, f"--hardware '{damaged}'",
                          "a damaged hardware profile")


# Found by these tests: load_profile lets the first two through, and the plan then fails later (a
# traceback; predictions of "nan s"), and meets the third with an OverflowError (a traceback).
@pytest.mark.parametrize("change,fragments", [
    pytest.param(_set(("links", "inside", "all_to_all"), {"points": [], "too_slow": None}),
                 ["inside/all_to_all"], id="a curve with no point and no too-slow size"),
    pytest.param(_set(("compute", "matmul_flops"), float("inf")), ["a damaged hardware profile"],
                 id="an infinite matmul rate"),
    pytest.param(_set(("memory_bytes",), float("inf")), ["a damaged hardware profile"], id="infinite memory"),
])
def test_a_profile_the_plan_cannot_price_is_refused_when_read(capsys, tmp_path, change, fragments):
    path = record_with(tmp_path, change)
    code, out, err = cli(capsys, "plan", "--cpu", "--hardware", path, *JOB, "--json")
    assert_one_line_error(code, err, exit_codes.CONFIG, f"--hardware '{path}'", *fragments)


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("fields,args,fragments", [
    pytest.param({"torch": "1.13.1"}, ["--cpu"],
                 ["was measured with torch 1.13.1", f"this is torch {torch.__version__}", "calibrate again"],
                 id="another torch"),
    pytest.param({}, [], ["was measured with gloo", "a GPU job (NCCL)", "add --cpu"], id="gloo profile, GPU plan"),
    pytest.param({"backend": "nccl", "device": "NVIDIA H100"}, ["--cpu"],
                 ["was measured with nccl", "a CPU job (gloo)", "drop --cpu"], id="nccl profile, CPU plan"),
    pytest.param({}, ["--cpu", "--nodes", f"{NODE},n7,n9"], [f"was measured on {NODE}", "not on the job's n7, n9"],
                 id="other nodes"),
    pytest.param({"nodes": {"b": [1], "a": [0]}}, ["--cpu", "--nodes", "c"], ["was measured on a, b", "job's c"],
                 id="other nodes, sorted"),
    pytest.param({}, ["--cpu", "--gpus-per-node", "4"],
                 ["--gpus-per-node places 4 ranks on a node", "was measured with 2", "calibrate with the job's ranks"],
                 id="--gpus-per-node"),
    pytest.param({}, ["--cpu", "--parallel.ranks_per_node=1"],
                 ["parallel.ranks_per_node places 1 ranks on a node", "was measured with 2"], id="ranks_per_node"),
    pytest.param({}, ["--gpu", "h100"], ["--gpu would contradict it", "drop --gpu, or drop --hardware"], id="--gpu"),
    pytest.param({}, ["--cpu", "--mfu", "0.5"], ["--mfu would contradict it"], id="--mfu"),
    pytest.param({}, ["--cpu", "--gpu", "h100", "--mfu", "0.5"], ["--gpu, --mfu would contradict it"], id="both"),
    pytest.param({}, ["--gpu-memory", "80", "--peak-tflops", "989", "--intra-gbps", "450", "--inter-gbps", "400"],
                 ["--gpu-memory, --peak-tflops, --intra-gbps, --inter-gbps would contradict it"], id="a custom GPU"),
])
def test_a_profile_of_other_hardware_or_a_contradicting_option_is_one_line(capsys, tmp_path, fields, args, fragments):
    path = written(a_profile(tmp_path / "p.json", **fields))
    code, out, err = cli(capsys, "plan", "--hardware", path, *JOB, *args)
    assert_one_line_error(code, err, exit_codes.CONFIG, *fragments)
    assert out == ""


def test_nodes_without_a_profile_is_one_line(capsys):
    for args in (["--nodes", "n0"], ["--cpu", "--nodes", "n0,n1"]):
        code, _, err = cli(capsys, "plan", *args)
        assert_one_line_error(code, err, exit_codes.CONFIG, "--nodes", "add --hardware PROFILE, or drop --nodes")


def test_a_cpu_plan_without_a_profile_still_refuses_gpu_options(capsys):
    code, _, err = cli(capsys, "plan", "--cpu", "--gpu", "h100")
    assert_one_line_error(code, err, exit_codes.CONFIG, "--gpu only apply to a GPU job", "--hardware PROFILE")


# ---------------------------------------------------------------------------- a CPU job priced on a profile


@pytest.fixture(scope="module")
def cpu_plan():
    """The JOB's plan as `plan --cpu` traces it (in this process, once)."""
    from trinity_train.config import default_config_path
    from trinity_train.parallel.node_layout import Nodes
    from trinity_train.plan.job import plan_job
    from trinity_train.run_config import load_run_config

    cfg = load_run_config(default_config_path(), list(JOB[2:]))
    return plan_job(cfg, 2, nodes=Nodes(2, "the profile"), gpu=False)


def test_each_traced_call_is_priced_by_its_kinds_curve_at_its_size(cpu_plan, tmp_path):
    from trinity_train.plan.report import summary

    profile = a_profile(tmp_path / "p.json", curves=two_point_curves())
    st = summary(cpu_plan, as_hardware(profile), profile.mfu)["step_time"]
    calls = cpu_plan.traces[0].collectives
    assert calls and not any(cpu_plan.crosses_nodes(c.group_ranks) for c in calls)
    expected = sum(profile.curves[("inside", wire_kind(c.category, c.kind, "gloo"))].seconds(c.sent) for c in calls)
    assert st["comm_s"] == pytest.approx(expected, rel=1e-12)
    # The same bytes priced as one call per (collective, kind) would differ: the curve has a latency,
    # and the traced calls of a row have different sizes.
    rows: dict = {}
    for c in calls:
        rows[(c.category, c.kind)] = rows.get((c.category, c.kind), 0.0) + c.sent
    lumped = sum(profile.curves[("inside", k)].seconds(sent) for (_, k), sent in rows.items())
    assert lumped != pytest.approx(expected, rel=1e-3)
    assert st["compute_s"] == pytest.approx(st["flops_per_gpu"] / STEP_FLOPS, rel=1e-12)
    assert st["predicted_s"] == st["no_overlap_s"] == pytest.approx(st["compute_s"] + st["comm_s"])


@pytest.fixture(scope="module")
def priced(tmp_path_factory) -> dict:
    """`plan --cpu --hardware P --nodes n0 JOB --json` on the linear-curve profile (in this process)."""
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    from trinity_train import cli as console

    path = written(a_profile(tmp_path_factory.mktemp("profile") / "p.json"))
    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = console.main(["plan", "--cpu", "--hardware", str(path), "--nodes", NODE, *JOB, "--json"])
    assert code == exit_codes.DONE, err.getvalue()[-3000:]
    return json.loads(out.getvalue())


def test_a_cpu_plan_on_a_gloo_profile_is_priced(priced):
    st, fit = priced["step_time"], priced["fit"]
    assert priced["layout"]["gpus_per_node"] == 2  # the profile's ranks per node
    assert st["mfu"] == pytest.approx(STEP_FLOPS / MATMUL_FLOPS) and st["gpu"] == "profile p.json"
    assert st["compute_s"] == pytest.approx(st["flops_per_gpu"] / STEP_FLOPS, rel=1e-12)
    assert st["profile"]["backend"] == "gloo" and st["profile"]["nodes"] == [NODE] and not st["profile"]["overlaps"]
    assert fit["memory_bytes"] == MEMORY and fit["fits"]
    assert all(c["reserve"] == {} for c in fit["classes"])  # a CPU rank holds no CUDA context or NCCL buffers
    assert priced["formula"]["reserve"] == {}
    assert priced["on_every_gpu"] is None  # the datasheet GPUs do not price a CPU job


def test_its_communication_is_each_rows_bytes_over_its_kinds_rate(priced):
    st, rows = priced["step_time"], priced["traffic"]
    assert rows and all(r["across_bytes"] == 0 for r in rows)
    # gloo's reduce-scatter is an all-to-all (parallel/gloo/reduce_scatter.py): traced as one. The
    # embedding's rows go both ways by all-to-alls (parallel/gloo/row_exchange.py); a data-free trace
    # counts the gather as the whole table's all-gather, which the profile prices as an all-to-all.
    assert {r["kind"] for r in rows if r["collective"].startswith("FSDP reduce-scatter")} == {"all_to_all"}
    (rows_gather,) = [r for r in rows if r["collective"] == "FSDP all-gather, embedding rows"]
    assert rows_gather["kind"] == "all_gather" and rows_gather["inside_bytes"] > 0
    on_the_wire = {"FSDP all-gather, embedding rows": "all_to_all"}
    expected = sum(r["inside_bytes"] / BANDWIDTH[on_the_wire.get(r["collective"], r["kind"])] for r in rows)
    assert st["comm_s"] == pytest.approx(expected, rel=1e-9)
    # (priced as the all-gather it is traced as, it would take less: all-gathers go faster here)
    assert st["comm_s"] > sum(r["inside_bytes"] / BANDWIDTH[r["kind"]] for r in rows)


def test_a_gloo_step_is_predicted_without_overlap(priced):
    from trinity_train.plan.report import render

    st = priced["step_time"]
    assert st["overlaps"] is False and st["comm_s"] > 0
    assert st["predicted_s"] == st["no_overlap_s"] == pytest.approx(st["compute_s"] + st["comm_s"])
    assert st["predicted_s"] > st["overlap_s"]
    text = render(priced)
    assert "step time on profile p.json: calibrated on n0 (2 ranks a node; cpu, gloo" in text
    assert "predicted: " in text and "the no-overlap bound" in text
    assert "no fit or step time without a profile" not in text


def test_a_call_larger_than_the_link_managed_is_one_line_naming_the_link(capsys, tmp_path):
    curves = {**linear_curves(), ("inside", "all_to_all"): Curve(((1e4, 1e-4),), too_slow=(1e5, 0.3))}
    path = written(a_profile(tmp_path / "slow.json", curves=curves))
    code, out, err = cli(capsys, "plan", "--cpu", "--hardware", path, *JOB, "--json")
    assert_one_line_error(code, err, exit_codes.CONFIG, f"{path}: the link inside a node was too slow to measure a "
                          "all-to-all of 0.1 MB within 0.3 s", "calibrate again with a longer --time-limit")
    assert out == ""


def test_a_cpu_search_on_a_gloo_profile_ranks_by_the_no_overlap_step(capsys, tmp_path):
    # No reduce-scatter measured: gloo runs FSDP's as all-to-alls, so the search never needs one.
    path = written(a_profile(tmp_path / "p.json", curves=linear_curves(("all_gather", "all_reduce", "all_to_all"))))
    found = plan_json(capsys, "--cpu", "--search", "--hardware", path, *JOB)
    assert found["overlaps"] is False and found["profile"]["backend"] == "gloo" and found["mfu"] == 0.5
    ranked = found["candidates"]
    assert len(ranked) >= 2
    assert all(c["predicted_s"] == c["no_overlap_s"] for c in ranked)
    assert [c["no_overlap_s"] for c in ranked] == sorted(c["no_overlap_s"] for c in ranked)
    assert all(c["compute_s"] > 0 and c["comm_s"] > 0 for c in ranked)


def test_the_datasheet_gpu_still_predicts_the_full_overlap_step(capsys):
    data = plan_json(capsys, "--gpu", "h100", *JOB)
    st, h100 = data["step_time"], GPUS["h100"]
    traced = data["traffic_totals"]["traced"]
    assert st["overlaps"] is True and st["profile"] is None and st["mfu"] == DEFAULT_MFU
    assert st["comm_s"] == pytest.approx(traced["inside_bytes"] / h100.intra_bytes_s + traced["across_bytes"]
                                         / h100.inter_bytes_s)
    assert st["predicted_s"] == st["overlap_s"] == max(st["compute_s"], st["comm_s"])
    assert st["compute_s"] == pytest.approx(st["flops_per_gpu"] / (h100.peak_tflops * 1e12 * DEFAULT_MFU))
    assert {g["gpu"] for g in data["on_every_gpu"]} == set(GPUS)
