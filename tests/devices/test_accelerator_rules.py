"""What a torch device hands the framework on an accelerator, checked without one.

torch's ``meta`` device stands in for an accelerator: its tensors are not on the CPU, so
every launch takes the accelerator's branches, and aten's operators run on it for shapes
and dtypes. A stand-in of the ``torch`` module enforces CUDA's own rules on the calls.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from opsched.ops import GROUP_NORM_BACKWARD
from opsched.ops._gnb_framework import framework_dtypes

torch = pytest.importorskip("torch")


class _Request:
    """The little of a scheduler request a framework launch reads."""

    def __init__(self, i: int, tensors: dict[str, Any], scalars: dict[str, Any]) -> None:
        self.id, self.op, self.tensors, self.scalars = i, GROUP_NORM_BACKWARD, tensors, scalars


def _cuda_like(calls: list[tuple[Any, ...]]) -> Any:
    """``torch``, but its ``native_group_norm_backward`` refuses mixed dtypes, as aten's
    CUDA kernel does (it reads every operand as the input's dtype)."""
    real = torch.ops.aten.native_group_norm_backward

    def group_norm_backward(dy, x, mean, rstd, gamma, *rest):
        dtypes = (dy.dtype, x.dtype, mean.dtype, rstd.dtype, gamma.dtype)
        calls.append(dtypes)
        if len(set(dtypes)) != 1:
            msg = f"expected scalar type {x.dtype} but found {set(dtypes) - {x.dtype}}"
            raise RuntimeError(msg)
        return real(dy, x, mean, rstd, gamma, *rest)

    aten = types.SimpleNamespace(native_group_norm_backward=group_norm_backward)
    proxy = types.SimpleNamespace(ops=types.SimpleNamespace(aten=aten))
    for name in dir(torch):
        if not name.startswith("__") and name != "ops":
            setattr(proxy, name, getattr(torch, name))
    return proxy


def _requests(count: int, n: int, dtype: Any, stat_dtype: Any, device: str) -> list[_Request]:
    c, hxw, group = 8, 5, 4
    made = []
    for i in range(count):
        tensors = {
            "grad_out": torch.empty(n, c, hxw, dtype=dtype, device=device),
            "input": torch.empty(n, c, hxw, dtype=dtype, device=device),
            "mean": torch.empty(n, group, dtype=stat_dtype, device=device),
            "rstd": torch.empty(n, group, dtype=stat_dtype, device=device),
            "gamma": torch.empty(c, dtype=stat_dtype, device=device),
            "dx": None, "dgamma": None, "dbeta": None,
        }  # fmt: skip
        scalars = {"N": n, "C": c, "HxW": hxw, "group": group, "output_mask": (True,) * 3}
        made.append(_Request(i, tensors, scalars))
    return made


@pytest.mark.parametrize("stat_dtype", ["same", "float32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("count", "n"), [(1, 2), (5, 2), (1, 512)], ids=["lone", "stack", "large"])
def test_an_accelerator_gets_one_dtype_and_results_in_the_requests_dtypes(
    count, n, dtype, stat_dtype
):
    stats = dtype if stat_dtype == "same" else torch.float32
    calls: list[tuple[Any, ...]] = []
    requests = _requests(count, n, dtype, stats, "meta")
    GROUP_NORM_BACKWARD.framework_batch(_cuda_like(calls), requests)
    assert calls and all(set(call) == {torch.float32} for call in calls)  # float32 for all
    for r in requests:
        assert r.tensors["dx"].dtype == dtype  # rounded once into the request's dtypes
        assert r.tensors["dgamma"].dtype == r.tensors["dbeta"].dtype == stats


def test_the_cpu_keeps_its_data_dtype_and_widens_only_the_statistics():
    x = torch.empty(2, 8, 5, dtype=torch.bfloat16)
    assert framework_dtypes(torch, x, torch.bfloat16) == (torch.bfloat16, torch.float32)
    meta = x.to("meta")
    assert framework_dtypes(torch, meta, torch.bfloat16) == (torch.float32, torch.float32)
    assert framework_dtypes(torch, meta.float(), torch.float32) == (torch.float32,) * 2


@pytest.mark.parametrize("m", [16, 63, 64, 65, 100, 128, 129, 300])
def test_tree_sums_give_a_row_its_bits_alone_and_in_any_stack(m):
    import numpy as np

    from opsched.ops.group_norm_grad import tree_sums

    rng = np.random.default_rng(m)
    row = torch.from_numpy(rng.standard_normal((1, 1, m)).astype(np.float32))
    alone = tree_sums(torch, row)
    assert alone.shape == (1, 1, 1)
    exact = float(np.sum(row.numpy().astype(np.float64)))
    assert abs(float(alone) - exact) <= 1e-5 * max(1.0, float(np.abs(row.numpy()).sum()))
    for rows, at in ((2, 1), (6, 0), (6, 5), (37, 20)):
        stack = torch.from_numpy(rng.standard_normal((rows, 1, m)).astype(np.float32))
        stack[at] = row[0]
        got = tree_sums(torch, stack)[at]
        assert got.view(torch.int32).item() == alone.view(torch.int32).item()


def test_group_norm_grad_sums_rows_by_the_tree_off_the_cpu():
    from opsched.ops import GROUP_NORM_GRAD

    x = torch.empty(3, 4, 5, 7, device="meta")  # rows of 35 elements
    tensors = {"x": x, "dy": x, "gamma": x, "mean": x[:, :, 0, 0], "rstd": x[:, :, 0, 0]}
    tensors["dx"] = torch.empty_like(x)
    calls = []
    real_cat = torch.cat

    def cat(*args, **kwargs):  # the tree's odd-length levels join with cat
        calls.append(args)
        return real_cat(*args, **kwargs)

    proxy = types.SimpleNamespace(
        **{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")}
    )
    proxy.cat = cat
    GROUP_NORM_GRAD.framework_call(proxy, tensors, {})
    assert calls  # 35 is odd: the tree ran (the CPU's path never joins)
