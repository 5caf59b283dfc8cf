"""The benchmark suite's timing order (benchmarks/common.py): every impl's CUDA
graph is timed twice, the impls in turn and then in reverse order, and the
mean of the two is what the row reports. graph_time is replaced by a stand-in
that runs the call once (so we see whose it is) and returns a figure of our
choosing, so this runs on the CPU."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import common  # noqa: E402


def make_case(ran):
    def impl(name):
        def fn(x):
            ran.append(name)
            return x + 1
        return fn
    x = torch.randn(64)
    return common.Case(op="probe", shape=(64,), dtype=torch.float32, direction="fwd", nbytes=512,
                       make_inputs=lambda grad: common.Inputs((x,)),
                       impls={"fusedops": impl("fusedops"), "eager": impl("eager"), "other": impl("other")})


def test_graphs_timed_in_mirrored_order_and_averaged(monkeypatch):
    ran, order = [], []
    seconds = iter([1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 11e-3])  # in the order graph_time is called

    def fake_graph_time(fn, device, calls=10):
        del ran[:]
        fn()
        order.append(ran[-1])
        return next(seconds)
    monkeypatch.setattr(common, "graph_time", fake_graph_time)
    rows = common.run_case(make_case(ran), torch.device("cpu"), {"GB/s": 1.0}, use_compile=False)
    assert order == ["fusedops", "eager", "other", "other", "eager", "fusedops"]
    by_impl = {r["impl"]: r for r in rows}
    for impl, (first, second) in {"fusedops": (1, 11), "eager": (2, 7), "other": (3, 5)}.items():
        r = by_impl[impl]
        assert r["gpu_ms_passes"] == [first, second], impl
        assert abs(r["gpu_ms"] - (first + second) / 2) < 1e-9, impl
        assert abs(r["gpu_GB/s"] - 512 / 1e9 / ((first + second) / 2e3)) < 1e-9, impl


def test_first_figure_stands_where_the_second_capture_fails(monkeypatch):
    ran = []
    calls = iter([2e-3, None])

    def fake_graph_time(fn, device, calls_=10):
        fn()
        return next(calls)
    case = make_case(ran)
    case.impls = {"fusedops": case.impls["fusedops"]}
    monkeypatch.setattr(common, "graph_time", fake_graph_time)
    (row,) = common.run_case(case, torch.device("cpu"), {"GB/s": 1.0}, use_compile=False)
    assert row["gpu_ms"] == 2 and "gpu_ms_passes" not in row


def test_compile_variants_are_columns_after_compile(monkeypatch):
    seen = []

    def fake_compile(fn, dynamic=None, options=None):
        seen.append(options)
        return fn
    monkeypatch.setattr(torch, "compile", fake_compile)
    case = make_case([])
    case.compile_options = {"exact": {"emulate_precision_casts": True}}
    fns = common._candidates(case, use_compile=True)
    assert list(fns) == ["fusedops", "eager", "other", "compile", "exact"]
    assert seen == [None, {"emulate_precision_casts": True}]
    x = torch.randn(5)
    assert torch.equal(fns["exact"](x), x + 1)  # eager's function, through its own wrapper
    assert list(common._candidates(case, use_compile=False)) == ["fusedops", "eager", "other"]


def test_norm_cases_ask_inductor_for_an_option_it_has():
    import torch._inductor.config as inductor_config
    from benchmarks import bench_norm
    gpu_cases = bench_norm.cases(torch.device("cuda"), quick=True, sweep=False)
    assert gpu_cases and all(c.compile_options == bench_norm.EXACT for c in gpu_cases)
    for options in bench_norm.EXACT.values():
        for key, value in options.items():
            assert type(getattr(inductor_config, key)) is type(value), key
    assert not any(c.compile_options for c in bench_norm.cases(torch.device("cpu"), quick=True, sweep=False))


def test_wall_clock_calls_by_call_length(monkeypatch):
    """The CPU timer's calls (warm-up and timed) for calls of a given length,
    on a fake clock that each call advances: 2 warm-ups and at least 5 timed
    calls up to SLOW_CALL_S, 1 warm-up and 3 timed calls past it (the slow
    CPU baselines), and the median of what the timed calls took."""
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])

    def calls_for(seconds):
        n = [0]

        def fn():
            n[0] += 1
            now[0] += seconds
        median = common.time_fn(fn, torch.device("cpu"))
        assert abs(median - seconds) < 1e-12
        return n[0]
    assert calls_for(0.5) == 2 + 5
    assert calls_for(0.9 * common.SLOW_CALL_S) == 2 + 5
    assert calls_for(1.5 * common.SLOW_CALL_S) == 1 + 3
    assert calls_for(10.0) == 1 + 3
    # Short calls: warm-ups for a quarter of the 0.3 s budget (75, or 76 as the
    # fake clock's sums round), then the budget's worth, capped at 200.
    assert 75 + 200 <= calls_for(1e-3) <= 76 + 200


def _rows(*cases):
    """Result rows of (op, unit, direction, {impl: rate}) cases."""
    return [{"op": op, "shape": "8x8", "dtype": "float32", "direction": d, "unit": unit, "impl": impl,
             unit: r, "frac_of_ceiling": r / 10}
            for op, unit, d, rates in cases for impl, r in rates.items()]


def test_verdict_counts_wins_and_names_the_worst_case():
    rows = _rows(("norm", "GB/s", "fwd", {"fusedops": 10, "eager": 5, "compile": 8}),
                 ("norm", "GB/s", "fwd+bwd", {"fusedops": 9, "eager": 3, "compile": 12}),
                 ("attention", "TFLOP/s", "fwd", {"fusedops": 2, "eager": 4}))
    assert common.verdict(rows) == ("verdict: fusedops is faster than eager in 2 of 3 cases, than "
                                    "torch.compile in 1 of 2 cases; worst 0.50x eager (attention 8x8 float32 fwd)")
    assert "no case" in common.verdict(_rows(("norm", "GB/s", "fwd", {"fusedops": 1})))


def test_small_ceilings_are_not_printed_as_zero():
    """A CPU's matmul rate (0.05 TFLOP/s, say) keeps its digits."""
    meta = {"ceiling": {"GB/s": 12.34, "buffer_bytes": 256 * common.MB},
            "matmul_ceiling": {"TFLOP/s": 0.0488, "dtype": "float32", "n": 1024}}
    assert common.ceiling_line(meta) == ("copy ceiling 12.3 GB/s (256 MiB, read + write); "
                                         "matmul ceiling 0.049 TFLOP/s (float32 1024^3)")


def test_plot_has_a_panel_per_unit_and_direction(tmp_path, monkeypatch):
    """TFLOP/s cases get panels of their own, and a CPU run's axis says wall time."""
    plt = pytest.importorskip("matplotlib.pyplot")
    made = []
    real = plt.subplots

    def subplots(*a, **k):
        fig, axes = real(*a, **k)
        made.append(axes)
        return fig, axes
    monkeypatch.setattr(plt, "subplots", subplots)
    rows = _rows(("norm", "GB/s", "fwd", {"fusedops": 10, "eager": 5}),
                 ("mlp", "TFLOP/s", "fwd+bwd", {"fusedops": 2, "eager": 4}))
    meta = {"device": "a CPU", "device_type": "cpu", "torch": torch.__version__,
            "ceiling": {"GB/s": 10.0, "buffer_bytes": 256 * common.MB},
            "matmul_ceiling": {"TFLOP/s": 0.05, "dtype": "float32", "n": 1024}}
    assert common.write_plot(tmp_path, meta, rows).exists()
    axes = made[0][:, 0]
    assert [ax.get_title() for ax in axes] == ["fwd (GB/s)", "fwd+bwd (TFLOP/s)"]
    assert [ax.get_ylabel() for ax in axes] == ["GB/s / copy ceiling (wall time)", "TFLOP/s / matmul ceiling (wall time)"]


def test_host_time_a_call_for_fusedops_and_eager(monkeypatch):
    """The "host us/call" figures: a loop of back-to-back calls for fusedops
    and eager (loop_time), not for other impls; the table shows both."""
    monkeypatch.setattr(common, "graph_time", lambda fn, device, calls=10: None)
    rows = common.run_case(make_case([]), torch.device("cpu"), {"GB/s": 1.0}, use_compile=False)
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["fusedops"]["host_us"] > 0 and by_impl["eager"]["host_us"] > 0
    assert "host_us" not in by_impl["other"]
    meta = {"device": "cpu", "torch": torch.__version__, "git_commit": "0" * 40, "timer": "t",
            "ceiling": {"GB/s": 1.0, "buffer_bytes": 1 << 20}, "device_type": "cpu"}
    table = common.format_table(meta, rows)
    assert "host us/call f/e" in table
    f, e = by_impl["fusedops"]["host_us"], by_impl["eager"]["host_us"]
    assert f < 100 and e < 100 and f"{f:.1f}/{e:.1f}" in table  # (x + 1 on 64 values: microseconds)
