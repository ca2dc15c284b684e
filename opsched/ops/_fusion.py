"""What the numpy devices' fused launches share: requests grouped by signature, their
operands gathered into a launch's rows, their results handed back.

Each operator's ``gather`` and ``scatter`` (its fusion layout) call these per signature
group: a group's requests have the same shapes, dtypes and scalars, so a few numpy calls
move the whole group. This room never imports the scheduler core, the devices or the CLI.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["GATHER_JOIN_BYTES", "deliver_each", "gather_into", "signature_groups"]


def deliver_each(
    requests: Sequence[Any], members: Iterable[int], name: str, results: Iterable[np.ndarray]
) -> None:
    """Hand each request ``requests[i]`` (``i`` in ``members``) its result of a fused launch,
    in order: copied into the caller's output ``name``, or, where its launch allocates that
    output (None), as a new array of its own (never a view of the launch's memory)."""
    for i, result in zip(members, results, strict=True):
        tensors = requests[i].tensors
        out = tensors[name]
        if out is None:
            tensors[name] = result.copy()
        else:  # (of the launch's dtype: no cast; ``np.copyto`` costs half again as much)
            out[...] = result


#: The largest array :func:`gather_into` joins as bytes: above it the copy itself costs
#: more than numpy's per-array checks, and joining copies every byte twice.
GATHER_JOIN_BYTES = 4096


def gather_into(parts: Sequence[np.ndarray], target: np.ndarray) -> None:
    """Copy ``parts`` (a signature group's operand: one shape, one dtype) one after another
    into ``target``, the contiguous rows of a fused operand that hold them all.

    Small C-contiguous parts of ``target``'s dtype are joined as raw bytes (``bytes.join``
    takes each array's buffer: one memcpy each, where ``np.concatenate`` checks every array
    first; 3x cheaper for 128 arrays of 4x4 float32, 1.7x for 256 of 8x64) and copied in
    once; any other group goes through ``np.concatenate`` (which casts and takes any
    strides).
    """
    first = parts[0]
    if (
        0 < first.nbytes <= GATHER_JOIN_BYTES  # (older numpy refuses an empty buffer)
        and (first.dtype is target.dtype or first.dtype == target.dtype)
        and target.flags.c_contiguous
    ):
        try:
            data = b"".join(parts)  # type: ignore[arg-type]  # ndarrays are bytes-like
        except (TypeError, ValueError, BufferError):  # a part that is not C-contiguous
            pass
        else:
            if len(data) == target.nbytes:
                target.reshape(-1)[...] = np.frombuffer(data, target.dtype)
                return
    np.concatenate(parts, out=target.reshape(-1, *first.shape[1:]))


def signature_groups(
    requests: Sequence[Any], key: Callable[[Any], Hashable] | None = None
) -> list[list[int]]:
    """The indices of ``requests`` grouped by signature, in order of first appearance.

    Requests with equal signatures have the same shapes, dtypes and scalars, so a fused
    launch's gather and scatter move a whole group with a few numpy calls instead of a few
    per request. A request without a signature is a group of its own, or, given ``key``,
    grouped with those of equal ``key(request)`` (a framework launch's shapes and scalars).
    """
    try:
        signatures = [request.signature for request in requests]
    except AttributeError:  # (a stand-in may have none)
        signatures = [getattr(request, "signature", None) for request in requests]
    first = signatures[0] if signatures else None
    if first is not None and signatures.count(first) == len(signatures):
        # the usual launch: one signature throughout (counted in C, by identity first)
        return [list(range(len(signatures)))]
    groups: dict[Hashable, list[int]] = {}
    last: Any = None  # the previous request's signature, and its group's members
    members: list[int] = []
    for i, (request, signature) in enumerate(zip(requests, signatures, strict=True)):
        if signature is last and signature is not None:
            # a run of calls seen before shares one signature object: no hashing (a
            # GroupNormBackward signature's hash costs more than the rest of this loop)
            members.append(i)
            continue
        group: Hashable = signature
        if signature is None:  # unsigned: alone, or by ``key``
            group = object() if key is None else key(request)
        found = groups.get(group)
        if found is None:
            found = groups[group] = []
        found.append(i)
        last, members = signature, found
    return list(groups.values())
