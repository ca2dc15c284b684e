"""Product profiles: which operators and dtypes each Ascend product supports.

The vendor's operator documents state, per product, whether an operator exists and which dtypes it
takes; the device's dtype check is per product. A scheduler (or a two-phase call) given
``product=`` checks every request as that product's runtime would:

- an operator the product does not have fails with ``ACLNN_ERR_INNER_FIND_KERNEL_ERROR``
  (561003), before any argument check (the product has no kernel to check for);
- a dtype outside the product's list fails with 161002, in the operator's own check order.

The table below is the only place products are described: adding one is one row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from opsched._errors import InnerError, Status

__all__ = [
    "GENERIC",
    "PRODUCTS",
    "OpSupport",
    "Product",
    "check_product",
    "product_named",
    "product_of_device",
    "resolve_product",
    "table_rows",
]

_ALL = ("DOUBLE", "FLOAT", "FLOAT16", "BFLOAT16")
_HALF = ("FLOAT", "FLOAT16", "BFLOAT16")
_NO_BF16 = ("DOUBLE", "FLOAT", "FLOAT16")


@attrs.frozen
class OpSupport:
    """What a product supports of one operator.

    Attributes:
        dtypes: the aclnn dtype names it takes.
        float_stats: GroupNormBackward only: the statistics (mean, rstd, gamma, dgamma,
            dbeta) may be FLOAT while grad_out, input and dx are FLOAT16 or BFLOAT16.
    """

    dtypes: tuple[str, ...]
    float_stats: bool = False
    #: The product's name, for messages (filled in by the table).
    product: str = "generic"


@attrs.frozen
class Product:
    """One product profile: its name, what it is, and its operators (absent: not there)."""

    name: str
    description: str
    ops: Mapping[str, OpSupport]


#: name -> profile. Columns: GluBackward, GroupNormalizationGrad, GroupNormBackward.
_TABLE: dict[str, tuple[str, tuple[str, ...] | None, tuple[str, ...] | None, OpSupport | None]] = {
    "generic": ("every operator, every dtype it takes", _ALL, _HALF, OpSupport(_HALF)),
    "ascend-950": ("Ascend 950PR / 950DT", _ALL, None, OpSupport(_HALF, float_stats=True)),
    "atlas-a3": ("Atlas A3 training / inference series", _ALL, None, OpSupport(_HALF)),
    "atlas-a2": ("Atlas A2 training / inference series", _ALL, _HALF, OpSupport(_HALF)),
    "atlas-200i-500-a2": ("Atlas 200I/500 A2 inference products", None, None, None),
    "atlas-inference": ("Atlas inference series", _NO_BF16, None, None),
    "atlas-training": ("Atlas training series", _NO_BF16, None, OpSupport(("FLOAT", "FLOAT16"))),
}


def _product(name: str, row: tuple[str, Any, Any, Any]) -> Product:
    description, glu, gng, gnb = row
    ops: dict[str, OpSupport] = {}
    if glu is not None:
        ops["GluBackward"] = OpSupport(glu, product=name)
    if gng is not None:
        ops["GroupNormalizationGrad"] = OpSupport(gng, product=name)
    if gnb is not None:
        ops["GroupNormBackward"] = attrs.evolve(gnb, product=name)
    return Product(name, description, ops)


#: Every product profile, by name.
PRODUCTS: dict[str, Product] = {name: _product(name, row) for name, row in _TABLE.items()}

#: The default: every operator with every dtype it takes (docs/operators.md).
GENERIC = PRODUCTS["generic"]


#: The SoC names the framework reports (``torch.npu.get_device_name()``), by prefix, most
#: specific first, and the product each belongs to.
_SOC_PREFIXES = (
    ("Ascend950", "ascend-950"),
    ("Ascend910_93", "atlas-a3"),
    ("Ascend910B", "atlas-a2"),
    ("Ascend910", "atlas-training"),
    ("Ascend310P", "atlas-inference"),
    ("Ascend310B", "atlas-200i-500-a2"),
)


def product_of_device(device_name: str) -> str | None:
    """The product of a device the framework names ``device_name`` (None: not known)."""
    for prefix, product in _SOC_PREFIXES:
        if device_name.startswith(prefix):
            return product
    return None


def resolve_product(configured: str, reported: str | None, device: str) -> Product:
    """The product a scheduler checks against: the configured one, or, when that is the
    default ``generic``, the one its device reports.

    Raises:
        ValueError: the configured product contradicts the device's.
    """
    if reported is None or configured == reported:
        return product_named(configured)
    if configured == "generic":
        return product_named(reported)
    msg = (
        f"product={configured!r} contradicts the device: {device} is a {reported} device; "
        f"leave product unset (generic) to use it, or set product={reported!r}"
    )
    raise ValueError(msg)


def product_named(name: object) -> Product:
    """The profile called ``name``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: no such product (the message lists them).
    """
    if not isinstance(name, str):
        msg = f"product must be a string such as 'atlas-a2', got {type(name).__qualname__}"
        raise TypeError(msg)
    product = PRODUCTS.get(name)
    if product is None:
        msg = f"unknown product {name!r}; expected one of {list(PRODUCTS)}"
        raise ValueError(msg)
    return product


def check_product(product: Product, op: str) -> OpSupport:
    """What ``product`` supports of ``op``, or 561003 naming the products that have it."""
    support = product.ops.get(op)
    if support is None:
        having = [p.name for p in PRODUCTS.values() if op in p.ops and p.name != "generic"]
        msg = (
            f"{op} is not available on {product.name} ({product.description}); "
            f"products that have it: {', '.join(having) or 'none'}"
        )
        raise InnerError(msg, status=Status.ERR_INNER_FIND_KERNEL_ERROR)
    return support


def table_rows() -> list[tuple[str, ...]]:
    """The table for ``opsched products``: name and one cell per operator."""
    rows = []
    for p in PRODUCTS.values():
        cells = []
        for op in ("GluBackward", "GroupNormalizationGrad", "GroupNormBackward"):
            s = p.ops.get(op)
            cell = "not available" if s is None else ", ".join(s.dtypes)
            if s is not None and s.float_stats:
                cell += " (FLOAT statistics allowed)"
            cells.append(cell)
        rows.append((p.name, p.description, *cells))
    return rows
