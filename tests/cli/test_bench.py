"""The benchmarks run (tiny workloads; no assertion on speed, only on their reports)."""

from __future__ import annotations

import dis
import io
import json
import pathlib
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from opsched.cli.bench_calls import (
    CALL_PATHS,
    FLOOR_ROWS,
    _counting,
    _tracing,
    bench_calls,
    print_calls,
)
from opsched.cli.bench_floors import FLOORS
from opsched.cli.bench_graphs import bench_graphs, print_graph_report
from opsched.cli.bench_kernels import bench_kernels, print_kernel_table
from opsched.cli.bench_paths import PATHS
from opsched.cli.bench_scheduler import bench_scheduler, print_scheduler_report

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_kernel_benchmark_reports_every_row():
    rows = bench_kernels(sizes=(1024, 4096), dtypes=("FLOAT", "BFLOAT16"))
    assert len(rows) == 3 * 2 * 2
    assert all(r["ratio_to_copy"] > 0 and r["speedup_vs_reference"] > 0 for r in rows)
    out = io.StringIO()
    print_kernel_table(rows, out)
    assert "GroupNormalizationGrad" in out.getvalue() and "BFLOAT16" in out.getvalue()
    assert "GroupNormBackward" in out.getvalue()


def test_the_reports_print_comparisons_not_targets():
    rows = [
        {
            "op": "GluBackward",
            "dtype": "FLOAT",
            "elements": 1 << 22,
            "fast_median_s": 0.001,
            "fast_gbps": 50.0,
            "copy_gbps": 40.0,
            "ratio_to_copy": 1.25,
            "speedup_vs_reference": 9.0,
            "torch_gbps": 25.0,
            "speedup_vs_torch": 2.0,
        }
    ]
    out = io.StringIO()
    print_kernel_table(rows, out)
    print_scheduler_report(
        {
            "repeats": 3,
            "device": "cpu",
            "latency": {"scheduler_median_us": 20, "direct_median_us": 12, "added_us": 8},
        },
        out,
    )
    text = out.getvalue()
    assert "2.00x" in text and "125%" in text and "= 8 us" in text
    assert "target" not in text and "reached" not in text


def test_kernel_benchmark_takes_at_least_the_repeats_asked_for():
    """``--repeats`` is a floor on the interleaved repeats of each row; large sizes get 9
    by default (small ones get more, up to 200)."""
    (default,) = bench_kernels(sizes=(1 << 20,), dtypes=("FLOAT",), ops=("glu",))
    (asked,) = bench_kernels(sizes=(1 << 20,), dtypes=("FLOAT",), ops=("glu",), repeats=12)
    assert (default["repeats"], asked["repeats"]) == (9, 12)


def test_kernel_rows_leave_out_each_loops_warm_rounds(monkeypatch):
    """The first rounds of each interleaved loop (caches still holding what ran before)
    are run but not counted: a launch that is slow only in them does not move a median."""
    from opsched.cli import bench_kernels

    warm, launches = bench_kernels._WARM_ROUNDS, []
    monkeypatch.setattr(bench_kernels, "_repeats", lambda nbytes, least=1: 5)

    def launch(workspace, size, ex):
        launches.append(len(launches))

    def clock(fn):  # seconds: 1 for a copy, peer or reference call; ours slow when warm
        before = len(launches)
        fn()
        if len(launches) == before:
            return 1.0
        return 100.0 if (len(launches) - 1) % (warm + 5) < warm else 0.5

    case = bench_kernels._glu_case(1024, np.float32, np.random.default_rng(0), None)
    monkeypatch.setattr(bench_kernels, "_timed", clock)
    row = bench_kernels._measure({**case, "launch": launch, "peer": lambda: None})
    assert len(launches) == 2 * (warm + 5)  # both loops ran their warm rounds
    assert row["fast_median_s"] == 0.5 and row["ratio_to_copy"] == 2.0
    assert row["speedup_vs_torch"] == 2.0


def test_scaling_figures_print_with_the_machines_copy_scaling():
    from opsched.cli.bench_scheduler import _copy_scaling

    copy = _copy_scaling()
    assert copy > 0
    scaling = {"requests": 64, "streams1_rps": 100.0, "streams2_rps": 180.0, "speedup": 1.8}
    out = io.StringIO()
    figures = {**scaling, "split_speedup": 1.5, "copy_speedup": copy}
    print_scheduler_report({"repeats": 1, "device": "cpu", "scaling": figures}, out)
    assert "4. split scaling, one GLU of 16M elements" in out.getvalue()
    assert f"(a copy: {copy:.2f}x)" in out.getvalue()


def test_scheduler_benchmark_small():
    result = bench_scheduler(repeats=1, parts=("throughput",), clients=4, per_client=5)
    for key in ("throughput_glu", "throughput_gn"):
        assert result[key]["requests"] == 20 and result[key]["speedup"] > 0
    out = io.StringIO()
    print_scheduler_report(result, out)
    assert "1. throughput" in out.getvalue() and "5. steady state" in out.getvalue()


def test_the_call_counter_counts_each_python_call_once():
    def leaf() -> None:
        pass

    def branch() -> None:
        leaf()
        leaf()

    with _counting() as read:
        before = read()
        for _ in range(100):
            branch()
        after = read()
    assert (after[0] - before[0], after[1] - before[1]) == (300, 300)


def test_the_bytecode_tracer_counts_each_instruction_run_once():
    def straight(a: int, b: int) -> int:
        c = a + b
        return c * 2

    def empty(a: int, b: int) -> None:
        return None

    def size(function: Any) -> int:  # no branch: each of its instructions runs once a call
        return len(list(dis.get_instructions(function)))

    def run(function: Any) -> tuple[int, int]:
        with _tracing() as read:
            before = read()
            for _ in range(100):
                function(1, 2)
            after = read()
        return after[0] - before[0], after[1] - before[1]

    (every, mine), (every_empty, mine_empty) = run(straight), run(empty)
    assert every == mine and every_empty == mine_empty  # one thread: the caller's
    assert mine - mine_empty == 100 * (size(straight) - size(empty))
    # a thread started in the block counts in every thread's, not in the caller's
    with _tracing() as read:
        before = read()
        worker = threading.Thread(target=straight, args=(1, 2))
        worker.start()
        worker.join()
        after = read()
    assert (after[0] - before[0]) - (after[1] - before[1]) >= size(straight)


def test_the_calls_benchmark_reports_every_path():
    figures = bench_calls(requests=512)
    assert set(figures) == {*CALL_PATHS, *FLOOR_ROWS}
    # a request enters at least its entry point, the checks, the kernel and the wake-up,
    # and runs more bytecodes than it enters functions
    assert all(bytecodes > every >= caller > 5 for every, caller, bytecodes in figures.values())
    out = io.StringIO()
    print_calls(figures, out)
    assert all(path in out.getvalue() for path in CALL_PATHS)
    # the bare batcher has nothing around asyncio's own wake-up: fewer calls and bytecodes
    # than its path
    for counted in ("all_threads", "bytecodes"):
        bare, featured = (getattr(figures[row], counted) for row in FLOOR_ROWS)
        assert bare < featured < getattr(figures["256 coroutines"], counted)


def test_paths_benchmark_reports_every_operator_and_path():
    result = bench_scheduler(repeats=2, parts=("paths",), clients=16, per_client=16)
    rows = result["paths"]["rows"]
    assert [(r["op"], r["path"]) for r in rows] == [
        *[("glu", path) for path in (*PATHS, *FLOORS)],
        *[("gnb", path) for path in (*PATHS, *FLOORS)],
        *[("gn", path) for path in PATHS if path != "two-phase"],  # the peer itself
    ]
    assert all(r["us"] > 0 and r["requests"] >= 1 for r in rows)
    # GroupNormalizationGrad's peer is its own two-phase call: measured with or without torch
    assert all(r["peer"] == "two-phase" and r["speedup_vs_peer"] > 0 for r in rows[-3:])
    out = io.StringIO()
    print_scheduler_report(result, out)
    assert "8. the per-request cost of every path" in out.getvalue()
    assert "GroupNormBackward 4x8x64, two-phase" in out.getvalue()
    assert "GroupNormalizationGrad 4x8x64, sync" in out.getvalue()
    # each ratio is the median of its rounds, printed with their spread
    for row in rows[-3:]:
        low, high = min(row["speedup_rounds"]), max(row["speedup_rounds"])
        assert len(row["speedup_rounds"]) == 2 and low <= row["speedup_vs_peer"] <= high
        label = f"GroupNormalizationGrad 4x8x64, {row['path']}"
        line = next(x for x in out.getvalue().splitlines() if x.startswith(label))
        assert line.endswith(f"(rounds {low:.2f}-{high:.2f}x)")


def test_the_direct_baseline_computes_each_operator_alone():
    """The two-phase call every figure calls direct does the real work: the bits of the
    demo's oracle (which checks each call in full first), for every operator."""
    from opsched.cli.bench_paths import INPUTS, two_phase_call
    from opsched.cli.solo import same_bits, solo_glu, solo_gn, solo_gnb

    rng = np.random.default_rng(9)
    oracles = {"glu": lambda g, x: solo_glu(g, x, -1), "gn": solo_gn, "gnb": solo_gnb}
    for op, oracle in oracles.items():
        for args in INPUTS[op](rng, 3):
            assert same_bits(two_phase_call(op)(*args), oracle(*args))


@pytest.mark.parametrize("torch_device", [False, True], ids=["numpy", "torch"])
def test_the_bare_batcher_computes_glu_backward(torch_device):
    # the floor row must do the real work, or its figure means nothing
    import asyncio

    from opsched.cli.bench_floors import _BareBatcher, _numpy_formula, _torch_aten
    from opsched.cli.bench_paths import glu_inputs
    from tests.sched_helpers import solo_glu

    inputs = glu_inputs(np.random.default_rng(4), 5)
    given = inputs
    if torch_device:
        torch = pytest.importorskip("torch")
        given = [(torch.from_numpy(g), torch.from_numpy(x)) for g, x in inputs]

    async def main():
        batcher = _BareBatcher(_torch_aten if torch_device else _numpy_formula)
        return await asyncio.gather(*(batcher.glu_backward(g, x) for g, x in given))

    for (g, x), got in zip(inputs, asyncio.run(main()), strict=True):
        np.testing.assert_allclose(np.asarray(got), solo_glu(g, x, -1), rtol=1e-5, atol=1e-6)


def _featured_glu(inputs, torch_device):
    """GluBackward requests for a featured floor, and its launch: numpy arrays and the
    product's kernel, or (``torch_device``) tensors of the same memory and aten's."""
    from opsched.cli.bench_floors import _numpy_kernel, _torch_aten

    if not torch_device:
        return inputs, _numpy_kernel
    torch = pytest.importorskip("torch")
    return [(torch.from_numpy(g), torch.from_numpy(x)) for g, x in inputs], _torch_aten


@pytest.mark.parametrize("torch_device", [False, True], ids=["numpy", "torch"])
def test_the_featured_batcher_computes_withdraws_and_orders_by_priority(torch_device):
    """The featured floor does the real work and keeps the features it claims: the
    operator's results (on numpy the same bits as the operator alone, each its own array),
    a cancelled waiter's request never launched, the higher priority first, a bad call
    refused."""
    import asyncio

    from opsched.cli.bench_floors import _FeaturedBatcher
    from opsched.cli.bench_paths import glu_inputs
    from tests.sched_helpers import solo_glu

    inputs = glu_inputs(np.random.default_rng(5), 6)
    given, launch = _featured_glu(inputs, torch_device)

    async def main():
        batcher = _FeaturedBatcher(launch)
        low = [asyncio.ensure_future(batcher.glu_backward(g, x)) for g, x in given[:3]]
        high = [asyncio.ensure_future(batcher.glu_backward(g, x, priority=1)) for g, x in given[3:]]
        await asyncio.sleep(0)  # every task queued its request
        low[1].cancel()
        order: list[int] = []
        for i, task in enumerate(low + high):
            task.add_done_callback(lambda _, i=i: order.append(i))
        results = await asyncio.gather(*low, *high, return_exceptions=True)
        with pytest.raises(ValueError, match="do not match"):
            await batcher.glu_backward(given[0][1], given[0][1])
        return batcher, results, order

    batcher, results, order = asyncio.run(main())
    assert isinstance(results[1], asyncio.CancelledError)
    assert batcher.completed == 5 and batcher.launches == 2  # one lane a priority
    assert order.index(3) < order.index(0)  # the high lane launched first
    for k in (0, 2, 3, 4, 5):
        g, x = inputs[k]
        if torch_device:  # the framework's call: its own last bits
            np.testing.assert_allclose(results[k].numpy(), solo_glu(g, x, -1), rtol=1e-5)
        else:
            assert np.array_equal(results[k], solo_glu(g, x, -1))
            assert results[k].base is None  # its own array, not a view of the launch's


def test_the_floors_run_on_a_torch_device_with_its_tensors():
    """On a torch device both floors batch the framework's tensors through its own call,
    for GLU and GroupNormBackward; the numpy devices have both operators' too."""
    pytest.importorskip("torch")
    from opsched.cli.bench_floors import floors_of, run_floor
    from opsched.cli.bench_kernels import BenchTarget
    from opsched.cli.bench_paths import INPUTS

    torch_cpu = BenchTarget("torch:cpu")
    for op in ("glu", "gnb"):
        inputs = INPUTS[op](np.random.default_rng(6), 8)
        assert floors_of(op, torch_cpu) == FLOORS
        for path in FLOORS:
            assert run_floor(path, torch_cpu, op, inputs, 512) > 0
    assert floors_of("gnb", BenchTarget()) == FLOORS
    assert floors_of("gn", torch_cpu) == floors_of("gn", BenchTarget()) == ()


@pytest.mark.parametrize("featured", [False, True], ids=["bare", "featured"])
def test_the_numpy_group_norm_backward_floors_compute_the_operators_results(featured):
    """Each request of a numpy GroupNormBackward floor (the formula on stacked operands;
    the product's table loop) gets its own dx, dgamma and dbeta: within the contract's
    FLOAT tolerance of the float64 oracle on its operands alone."""
    import asyncio

    from opsched.cli.bench_floors import (
        _BareBatcher,
        _FeaturedBatcher,
        _numpy_gnb_formula,
        _numpy_gnb_kernel,
    )
    from opsched.ops import GROUP_NORM_BACKWARD

    rng = np.random.default_rng(8)
    requests = [GROUP_NORM_BACKWARD.example(rng) for _ in range(5)]
    # each request's values differ (gamma too): a mix-up between requests shows
    requests = [
        (dy, x, m, r, g * (i + 1), *rest) for i, (dy, x, m, r, g, *rest) in enumerate(requests)
    ]

    async def main():
        if featured:
            batcher = _FeaturedBatcher(_numpy_gnb_kernel)
        else:
            batcher = _BareBatcher(_numpy_gnb_formula)
        return await asyncio.gather(*(batcher.group_norm_backward(*args) for args in requests))

    rtol, atol = GROUP_NORM_BACKWARD.tolerance(np.float32)
    for args, got in zip(requests, asyncio.run(main()), strict=True):
        for g, w in zip(got, GROUP_NORM_BACKWARD.oracle(*args), strict=True):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _torch_gnb_requests(rng, k):
    from opsched.cli.bench_medium import as_tensors
    from opsched.cli.bench_paths import gnb_inputs

    return as_tensors(gnb_inputs(rng, k))


@pytest.mark.parametrize("featured", [False, True], ids=["bare", "featured"])
def test_the_group_norm_backward_floors_compute_the_frameworks_results(featured):
    """Each request of a stacked GroupNormBackward floor gets the framework's own call's
    dx, dgamma and dbeta on its operands alone (within float32 rounding: the floor sums
    the per-sample parts in its own order)."""
    import asyncio

    torch = pytest.importorskip("torch")
    from opsched.cli.bench_floors import _BareBatcher, _FeaturedBatcher, _torch_gnb

    requests = _torch_gnb_requests(np.random.default_rng(7), 5)
    # each request's values differ (gamma too): a mix-up between requests shows
    requests = [
        (dy, x, m, r, g * (i + 1), *rest) for i, (dy, x, m, r, g, *rest) in enumerate(requests)
    ]

    async def main():
        batcher = _FeaturedBatcher(_torch_gnb) if featured else _BareBatcher(_torch_gnb)
        return await asyncio.gather(*(batcher.group_norm_backward(*args) for args in requests))

    results = asyncio.run(main())
    for (dy, x, mean, rstd, gamma, n, c, hxw, group), got in zip(requests, results, strict=True):
        want = torch.ops.aten.native_group_norm_backward(
            dy, x, mean, rstd, gamma, n, c, hxw, group, [True, True, True]
        )
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["glu", "gnb"])
@pytest.mark.parametrize("torch_device", [False, True], ids=["numpy", "torch"])
def test_the_featured_floor_gives_a_request_the_same_bits_alone_and_in_a_batch(op, torch_device):
    """The featured floor keeps the scheduler's batch invariance, as it claims: each
    request's results are the same bits whether it launched alone or with others (a floor
    without it would be measuring a batcher that drops a feature the scheduler keeps)."""
    import asyncio

    from opsched.cli.bench_floors import (
        _FeaturedBatcher,
        _numpy_gnb_kernel,
        _numpy_kernel,
        _torch_aten,
        _torch_gnb,
    )
    from opsched.cli.bench_paths import INPUTS

    inputs = INPUTS[op](np.random.default_rng(11), 9)
    launch = {"glu": _numpy_kernel, "gnb": _numpy_gnb_kernel}[op]
    if torch_device:
        pytest.importorskip("torch")
        from opsched.cli.bench_medium import as_tensors

        inputs = as_tensors(inputs)
        launch = {"glu": _torch_aten, "gnb": _torch_gnb}[op]
    call = "glu_backward" if op == "glu" else "group_norm_backward"

    async def together():
        batcher = _FeaturedBatcher(launch)
        results = await asyncio.gather(*(getattr(batcher, call)(*args) for args in inputs))
        assert batcher.launches == 1  # all of them in one launch
        return results

    async def alone():
        batcher = _FeaturedBatcher(launch)
        results = [await getattr(batcher, call)(*args) for args in inputs]
        assert batcher.launches == len(inputs)  # each request a launch of its own
        return results

    def bits(result):
        parts = result if isinstance(result, tuple) else (result,)
        return [np.asarray(p).tobytes() for p in parts]

    for one, batched in zip(asyncio.run(alone()), asyncio.run(together()), strict=True):
        assert bits(one) == bits(batched)


def test_the_featured_group_norm_backward_floor_checks_each_new_signature():
    import asyncio

    torch = pytest.importorskip("torch")
    from opsched.cli.bench_floors import _FeaturedBatcher, _torch_gnb

    dy, x, mean, rstd, gamma, n, c, hxw, group = _torch_gnb_requests(np.random.default_rng(8), 1)[0]

    async def main():
        batcher = _FeaturedBatcher(_torch_gnb)
        await batcher.group_norm_backward(dy, x, mean, rstd, gamma, n, c, hxw, group)
        with pytest.raises(ValueError, match="do not match"):  # gamma of C + 1
            await batcher.group_norm_backward(
                dy, x, mean, rstd, torch.ones(c + 1), n, c, hxw, group
            )
        with pytest.raises(ValueError, match="do not match"):  # 3 groups of 8 channels
            await batcher.group_norm_backward(dy, x, mean, rstd, gamma, n, c, hxw, 3)
        return batcher.completed

    assert asyncio.run(main()) == 1


def test_the_scheduler_benchmarks_give_a_torch_device_tensors_on_that_device():
    # on torch:cuda the throughput, medium and floor rows must pass tensors on the GPU (the
    # scheduler refuses tensors on another device); torch's meta device stands in for one
    pytest.importorskip("torch")
    from opsched.cli.bench_kernels import BenchTarget
    from opsched.cli.bench_medium import on_device
    from opsched.cli.bench_paths import gnb_inputs

    work = gnb_inputs(np.random.default_rng(10), 2)
    assert on_device(BenchTarget(), work) is work  # numpy devices: the arrays as they are
    for device, kind in (("torch:cpu", "cpu"), ("torch:meta", "meta")):
        for given, args in zip(work, on_device(BenchTarget(device), work), strict=True):
            for a, b in zip(given, args, strict=True):
                if isinstance(a, np.ndarray):
                    assert b.device.type == kind and tuple(b.shape) == a.shape
                else:
                    assert b == a  # the scalars as they are


@pytest.mark.parametrize("device", ["cpu", "torch:cpu"])
def test_medium_benchmark_reports_every_operator_and_size(device):
    pytest.importorskip("torch")
    from opsched.cli.bench_kernels import BenchTarget
    from opsched.cli.bench_medium import SIZES, bench_medium, print_medium

    result = bench_medium(BenchTarget(device), repeats=1, round_bytes=1)  # 32 requests each
    rows = result["rows"]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        (op, size) for op in ("glu_backward", "group_norm_backward") for size in SIZES
    ]
    assert all(r["requests"] == 32 and r["speedup"] > 0 for r in rows)
    lines: list[str] = []
    print_medium(result, lambda name, *rest: lines.append(name), io.StringIO())
    assert lines[0] == "10. medium, glu_backward 64 KiB x 32"


def test_graph_benchmark_small():
    result = bench_graphs(rounds=1, clients=2, repeats=1)
    assert result["chains"] == 2 and result["graph_chains_per_s"] > 0
    out = io.StringIO()
    print_graph_report(result, out)
    assert "(a) / (b)" in out.getvalue()


def test_benchmark_script_writes_json(tmp_path):
    path = tmp_path / "k.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_kernels.py"),
            "--sizes",
            "1K",
            "--dtypes",
            "FLOAT",
            "--json",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(path.read_text())
    assert data["benchmark"] == "kernels" and len(data["results"]["kernels"]) == 3


def test_torch_peer_columns_where_torch_is_installed():
    pytest.importorskip("torch")
    rows = bench_kernels(sizes=(4096,), dtypes=("FLOAT",))
    assert all(r["torch_gbps"] > 0 and r["speedup_vs_torch"] > 0 for r in rows)
    result = bench_scheduler(repeats=1, parts=("throughput",), clients=2, per_client=3)
    for key in ("throughput_glu", "throughput_gn", "throughput_gnb"):
        assert result[key]["torch_rps"] > 0
    out = io.StringIO()
    print_kernel_table(rows, out)
    print_scheduler_report(result, out)
    assert "vs torch" in out.getvalue() and "torch's operator per request (torch CPU)" in (
        out.getvalue()
    )
    assert "reached" not in out.getvalue()


def test_the_cost_targets_measure_every_row_against_torch_beside_its_target():
    pytest.importorskip("torch")
    from opsched.cli.bench_targets import _tiny_rows, bench_targets, print_targets

    result = bench_targets(rounds=2, quick=True, groups=("mixed",))
    rows = {row["path"]: row for row in result["rows"]}
    assert result["rounds"] == 2 and len(rows) == 4  # each operator's, and its floor's
    assert rows["GroupNormBackward, torch:cpu, mixed shapes, 256 coroutines"]["target"] == 0.8
    assert rows["GLU, torch:cpu, mixed shapes, floor: featured batcher"]["target"] is None
    for row in rows.values():
        assert len(row["rounds"]) == 2 and row["ratio"] > 0 and row["us"] > 0
        assert row["peer_us"] > 0 and row["requests"] == 2048
    out = io.StringIO()
    print_targets(result, out)
    text = out.getvalue()
    assert "median of 2 interleaved rounds" in text and text.count(">= ") == 2
    assert text.count("(a floor)") == 2
    # the tiny rows: every way in with its target, the floors beside them without one
    tiny = {row.label: row.target for row in _tiny_rows(256)}
    assert tiny["GLU, module-level `await opsched.glu_backward`, 256 coroutines"] == 1.0
    assert tiny["GroupNormBackward 4x8x64, torch:cpu, 256 coroutines"] == 0.8
    assert tiny["GLU, floor: featured batcher"] is None
    with pytest.raises(ValueError, match="unknown cost-target group"):
        bench_targets(groups=("tiny", "huge"))


def test_the_medium_cost_targets_run_both_floors_beside_each_row():
    """Every medium row (both operators, every size, both devices) has the bare and the
    featured batcher beside it in the same rounds, from the same 32 coroutines; a floor
    row has no target and measures a real round."""
    pytest.importorskip("torch")
    from opsched.cli.bench_medium import SIZES
    from opsched.cli.bench_targets import _medium_rows

    rows = _medium_rows(1)  # 32 requests a row
    labels = {row.label: row for row in rows}
    assert len(rows) == 2 * 2 * len(SIZES) * 3
    for where in ("", ", torch:cpu"):
        for name in ("GLU", "GroupNormBackward"):
            assert labels[f"{name} medium 64 KiB{where}, 32 coroutines"].target == 0.95
            for floor in FLOORS:
                row = labels[f"{name} medium 64 KiB{where}, floor: {floor}"]
                assert row.target is None and row.requests == 32
                peer, path = row.round()
                assert peer > 0 and path > 0


def test_the_medium_rows_peer_drops_each_result_as_the_scheduler_s_clients_do(monkeypatch):
    """The peer of a medium row holds one result at a time, as the coroutines awaiting the
    scheduler do: a peer that kept every result would pay for fresh memory on each call
    (page faults) that the scheduler's path reuses, and flatter every medium ratio."""
    pytest.importorskip("torch")
    import gc
    import weakref

    from opsched.cli import bench_targets

    alive: set[int] = set()
    most = [0]

    class Result:
        pass

    def peer(args):
        result = Result()
        alive.add(id(result))
        weakref.finalize(result, alive.discard, id(result))
        most[0] = max(most[0], len(alive))
        return result

    monkeypatch.setattr(bench_targets, "_gnb_peer", peer)
    monkeypatch.setattr(bench_targets, "_glu_peer", peer)
    gc.disable()  # (only reference counting frees the results)
    try:
        row = bench_targets._medium_rows(1)[0]  # 32 requests
        assert row.requests == 32
        row.round()
    finally:
        gc.enable()
    assert 1 <= most[0] <= 2


def test_the_burst_rows_peer_keeps_every_result_as_the_burst_does(monkeypatch):
    """Beside the burst of futures, whose results all live until the last is read, the
    peer keeps each result until its last call, after an untimed pass that keeps them too
    (both windows then find that memory in the allocator's hands); beside a path whose
    callers drop each result, the peer holds one at a time."""
    pytest.importorskip("torch")
    import gc
    import weakref

    from opsched.cli import bench_targets

    alive: set[int] = set()
    most: list[int] = []

    class Result:
        pass

    def counting(op, inputs):
        def peer(k):
            result = Result()
            alive.add(id(result))
            weakref.finalize(result, alive.discard, id(result))
            most.append(len(alive))
            return result

        return peer

    monkeypatch.setattr(bench_targets, "torch_per_request", counting)
    rows = {row.label: row for row in bench_targets._tiny_rows(256)}
    gc.disable()  # (only reference counting frees the results)
    try:
        for label, keeps in (
            ("GLU, a burst of `submit_glu_backward` futures, one thread", True),
            ("GLU, `await sched.glu_backward`, 256 coroutines", False),
        ):
            most.clear()
            rows[label].round()
            if keeps:  # the untimed pass, then the timed one: each holds all 256 at its end
                assert len(most) == 2 * 256
                assert most[255] == most[-1] == 256
            else:
                assert len(most) == 256 and max(most) <= 2
    finally:
        gc.enable()


@pytest.mark.parametrize("torch_device", [False, True], ids=["numpy", "torch"])
def test_the_featured_floor_runs_large_and_mixed_requests_on_their_own_arrays(torch_device):
    """Requests of OWN_ELEMENTS run on their own arrays (numpy: GluBackward's table loop,
    each request's solo bits in an array of its own; torch: the framework's own call),
    and on a torch device requests of many shapes each get their own shape's result."""
    import asyncio

    from opsched.cli.bench_floors import OWN_ELEMENTS, _FeaturedBatcher
    from opsched.cli.bench_targets import mixed_glu
    from tests.sched_helpers import solo_glu

    rng = np.random.default_rng(9)
    rows = OWN_ELEMENTS // 64
    inputs = [
        tuple(rng.standard_normal((rows, cols)).astype(np.float32) for cols in (32, 64))
        for _ in range(3)
    ] + (mixed_glu(rng, 6) if torch_device else [])
    given, launch = _featured_glu(inputs, torch_device)

    async def main():
        batcher = _FeaturedBatcher(launch)
        return await asyncio.gather(*(batcher.glu_backward(g, x) for g, x in given))

    for (g, x), got in zip(inputs, asyncio.run(main()), strict=True):
        if torch_device:
            import torch

            want = torch.ops.aten.glu_backward(torch.from_numpy(g), torch.from_numpy(x), -1)
            assert torch.equal(got, want)  # the framework's own call: its bits
        else:
            assert np.array_equal(got, solo_glu(g, x, -1)) and got.base is None


def test_the_kernel_benchmarks_torch_peers_write_into_outputs_made_once(monkeypatch):
    """The kernel figure's torch GluBackward and GroupNormalizationGrad write into one
    output made once, as our launches write into the out arrays given to the two-phase
    call; GroupNormBackward's is the plain call (its out variant makes new tensors too)."""
    torch = pytest.importorskip("torch")
    from opsched.cli import bench_kernels

    given: dict[str, list] = {"glu": [], "gn": [], "gnb": []}

    def record(name):
        def peer(*args, out=None, **kw):
            given[name].append(out)

        return peer

    monkeypatch.setattr(bench_kernels._aten, "glu_backward", record("glu"))
    monkeypatch.setattr(bench_kernels._aten, "group_norm_grad", record("gn"))
    monkeypatch.setattr(bench_kernels._aten, "group_norm_backward", record("gnb"))
    rng = np.random.default_rng(0)
    for case in (bench_kernels._glu_case, bench_kernels._gn_case, bench_kernels._gnb_case):
        peer = case(4096, np.float32, rng, torch)["peer"]
        peer()
        peer()
    for name in ("glu", "gn"):
        first, second = given[name]
        assert isinstance(first, torch.Tensor) and first is second  # made once, reused
    assert given["gnb"] == [None, None]


def test_the_graph_floor_fuses_each_step_of_every_run_and_keeps_the_chains_bits():
    """The graph floor runs 8 clients' chains as graphs: each step of the 8 runs is one
    launch (a node queued in its signature's lane, shared by every run), and every run
    returns what its chain awaited node by node on the scheduler returns, bit for bit."""
    import asyncio

    import opsched
    from opsched.cli.bench_floors import _GraphFloor
    from opsched.cli.bench_graphs import _Chain

    chains = [_Chain(np.random.default_rng(seed)) for seed in range(8)]

    async def main() -> tuple[list[Any], _GraphFloor]:
        floor = _GraphFloor()
        nodes = [floor.nodes_of(chain.steps) for chain in chains]
        return await asyncio.gather(*(floor.run(n) for n in nodes)), floor

    outs, floor = asyncio.run(main())
    for batcher in floor._batchers.values():  # 4 nodes of each kind a chain
        assert batcher.launches == 4 and batcher.completed == 4 * len(chains)

    async def awaited() -> list[Any]:
        async with opsched.open_scheduler() as sched:
            return [await chain.as_awaits(sched) for chain in chains]

    for got, expected in zip(outs, asyncio.run(awaited()), strict=True):
        assert got.shape == (2, 4, 128) and np.array_equal(got, expected)


def test_a_cancelled_graph_floor_run_never_launches_its_queued_node():
    """Cancelling the caller awaiting a run on the graph floor withdraws its queued node: the
    step's launch takes the other run's node alone, and the other run ends as usual."""
    import asyncio

    from opsched.cli.bench_floors import _GraphFloor
    from opsched.cli.bench_graphs import _Chain

    chains = [_Chain(np.random.default_rng(seed)) for seed in range(2)]

    async def main() -> tuple[Any, BaseException | Any, _GraphFloor]:
        floor = _GraphFloor()
        kept, dropped = (asyncio.ensure_future(floor.run(floor.nodes_of(c.steps))) for c in chains)
        await asyncio.sleep(0)  # both runs queued their first node; nothing launched yet
        dropped.cancel()
        results = await asyncio.gather(kept, dropped, return_exceptions=True)
        return results[0], results[1], floor

    out, error, floor = asyncio.run(main())
    assert isinstance(error, asyncio.CancelledError)
    assert out.shape == (2, 4, 128)
    for batcher in floor._batchers.values():  # only the kept run's 4 nodes of each kind
        assert batcher.launches == 4 and batcher.completed == 4


def test_the_graph_floor_checks_each_new_node_signature():
    """A node whose arrays do not fit its operator is refused when its chain is prepared,
    naming the node's kind and arrays."""
    import asyncio

    from opsched.cli.bench_floors import _GraphFloor

    x = np.zeros((2, 4, 8), np.float32)
    stats = np.zeros((2, 4), np.float32)

    async def main() -> None:
        floor = _GraphFloor()
        with pytest.raises(ValueError, match=r"a gn node's arrays do not fit .*\(2, 3\)"):
            floor.nodes_of([("gn", (x, x, x, np.zeros((2, 3), np.float32), stats))])
        with pytest.raises(ValueError, match="a glu node's arrays do not fit"):
            floor.nodes_of([("glu", (np.zeros((2, 3), np.float32),))])
        assert len(floor.nodes_of([("gn", (x, x, x, stats, stats))])) == 1

    asyncio.run(main())


def test_the_graph_row_has_the_featured_floor_beside_it():
    """The graph target group measures the scheduler's graph runs and the graph floor's
    against the same peer, the chains awaited: the floor row has no target and shares the
    row's family, so its rounds decide whether the row is blocked."""
    pytest.importorskip("torch")
    from opsched.cli.bench_targets import _graph_rows

    row, floor = _graph_rows(2, 1)
    assert (row.target, floor.target) == (1.2, None)
    assert floor.label == f"{row.label}, floor: featured batcher"
    assert row.family == floor.family and row.peer == floor.peer == "awaited chains"
    peer, path = floor.round()
    assert peer > 0 and path > 0
