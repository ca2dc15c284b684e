"""What every operator description shares: the dtype table, argument checks, the base class.

An operator description holds what is true of its operator on every device: its public
call (parameters, from which every entry point is generated: ``scripts/gen_entry_points.py``),
its checks (docs/operators.md) in their order, outputs, the fusion key and units, how it
splits, its tolerance, its float64 oracle and its example inputs. Each device brings its
own launcher of it (``opsched/devices/host/``, ``opsched/devices/torch/``). The scheduler,
graphs and the stress harness talk only to descriptions and devices, so a new operator is
one new module here, its kernels and its launchers.

This room never imports the scheduler core, the devices or the CLI.
"""

from __future__ import annotations

import abc
import ast
import inspect
import itertools
import operator
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import ml_dtypes
import numpy as np

from opsched._errors import ParamInvalidError, ParamNullptrError
from opsched.ops.products import OpSupport, Product, check_product

__all__ = [
    "ARRAY_TYPES",
    "DTYPE_NAMES",
    "FusedGeometry",
    "Launch",
    "Operator",
    "Parameter",
    "Tensors",
    "check_dtype",
    "check_present",
    "check_array_kind",
    "check_types",
    "check_writable",
    "cuts",
    "dtype_name",
    "entry_point",
    "index_value",
    "may_overlap",
    "register_array_type",
    "shapes_and_dtypes",
]

#: aclnn dtype names of the numpy dtypes opsched computes in (docs/operators.md, "Common rules").
DTYPE_NAMES: dict[np.dtype, str] = {
    np.dtype(np.float64): "DOUBLE",
    np.dtype(np.float32): "FLOAT",
    np.dtype(np.float16): "FLOAT16",
    np.dtype(ml_dtypes.bfloat16): "BFLOAT16",
}

Tensors = Mapping[str, np.ndarray]

#: A prepared launch (a device launcher's): ``launch(tensors, workspace)``.
Launch = Callable[[Mapping[str, Any], "np.ndarray | None"], None]

#: The arrays of a fused launch, ``name -> (shape, dtype)``, and its scalar arguments.
FusedGeometry = tuple[dict[str, tuple[tuple[int, ...], np.dtype]], dict[str, Any]]


def dtype_name(dtype: np.dtype) -> str:
    """The aclnn name of ``dtype`` (e.g. ``FLOAT16``), else numpy's name."""
    name = DTYPE_NAMES.get(np.dtype(dtype))
    return name if name is not None else str(dtype)


def check_present(op: str, **tensors: object) -> None:
    """Raise ParamNullptrError (161001) for the first argument that is None."""
    for name, value in tensors.items():
        if value is None:
            msg = f"{op}: {name} is None; a tensor (numpy array) is required"
            raise ParamNullptrError(msg)


#: The array kinds opsched computes on: plain arrays and memory-mapped ones (plain data
#: in a file). Other ndarray subclasses carry meaning the kernels would silently drop (a
#: masked array's mask, a matrix's algebra), so they are refused.
ARRAY_KINDS = (np.ndarray, np.memmap)


def check_array_kind(op: str, name: str, value: object) -> None:
    """Raise TypeError unless ``value`` is a plain numpy array (or a memmap)."""
    kind = type(value)
    if kind is np.ndarray or kind is np.memmap:
        return
    what = f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(value, np.ma.MaskedArray):
        msg = (
            f"{op}: {name} is a masked array ({what}); opsched would ignore its mask. Pass "
            f"{name}.filled(value) or numpy.asarray({name}) to compute on its data"
        )
    elif isinstance(value, np.ndarray):
        msg = (
            f"{op}: {name} is a {what}, a numpy.ndarray subclass opsched does not compute on; "
            f"pass numpy.asarray({name})"
        )
    elif kind.__module__.startswith("torch") and hasattr(value, "data_ptr"):
        msg = (
            f"{op}: {name} is a {what}; this scheduler's device computes numpy arrays. Open "
            f'a scheduler with device="torch:cpu" (or "torch:cuda", "torch:npu") to compute '
            f"tensors, or pass {name}.numpy()"
        )
    else:
        msg = f"{op}: {name} must be a numpy.ndarray, got {what}"
    raise TypeError(msg)


def check_types(op: str, **tensors: object) -> None:
    """Raise TypeError for the first argument that is neither None nor a plain numpy
    array (:func:`check_array_kind`)."""
    for name, value in tensors.items():
        if value is not None:
            check_array_kind(op, name, value)


def shapes_and_dtypes(values: Sequence[Any]) -> list[Any] | None:
    """Each of ``values`` as what the checks depend on of it: ``(shape, dtype)`` of a numpy
    array (exactly ``np.ndarray``), None for None; None when any is something else."""
    parts: list[Any] = []
    for value in values:
        if value is None:
            parts.append(None)
        elif type(value) is np.ndarray:
            parts.append((value.shape, value.dtype))
        else:
            return None
    return parts


def check_writable(op: str, outputs: Sequence[str], tensors: Mapping[str, Any]) -> None:
    """Raise ParamInvalidError (161002) for an output numpy array that cannot be written."""
    for name in outputs:
        value = tensors.get(name)
        if isinstance(value, np.ndarray) and not value.flags.writeable:
            msg = (
                f"{op}: {name} is read-only (its writeable flag is False); pass a writeable "
                "array, or None to have one allocated"
            )
            raise ParamInvalidError(msg)


def check_dtype(
    op: str,
    allowed: tuple[np.dtype, ...],
    reference: tuple[str, np.ndarray],
    *,
    product: str = "generic",
    **tensors: Any,
) -> None:
    """Raise ParamInvalidError (161002) for a dtype outside ``allowed`` or unlike the
    reference tensor's, checking the reference first and then ``tensors`` in order.
    ``product``: whose list ``allowed`` is (named in the message unless generic)."""
    ref_name, ref = reference
    for name, value in {ref_name: ref, **tensors}.items():
        if value is None:
            continue
        if value.dtype not in allowed:
            names = ", ".join(dtype_name(d) for d in allowed)
            if product == "generic":
                msg = f"{op}: {name}.dtype is {dtype_name(value.dtype)}; expected one of {names}"
            else:
                msg = (
                    f"{op}: {name}.dtype is {dtype_name(value.dtype)}; on {product} {op} "
                    f"takes {names}"
                )
            raise ParamInvalidError(msg)
        if value.dtype != ref.dtype:
            msg = (
                f"{op}: {name}.dtype is {dtype_name(value.dtype)} but {ref_name}.dtype is "
                f"{dtype_name(ref.dtype)}; they must be equal"
            )
            raise ParamInvalidError(msg)


#: numpy dtypes by aclnn name.
DTYPES_BY_NAME: dict[str, np.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def index_value(op: str, name: str, value: object) -> int:
    """Return ``value`` as an int when it is a Python or numpy integer (not bool)."""
    if isinstance(value, bool | np.bool_):
        msg = f"{op}: {name} must be an integer, got bool {value!r}"
        raise TypeError(msg)
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        msg = f"{op}: {name} must be an integer, got {type(value).__qualname__} {value!r}"
        raise TypeError(msg) from None


def may_overlap(out: np.ndarray, array: np.ndarray | None) -> bool:
    """Whether ``out`` may share memory with ``array`` (``np.may_share_memory``'s bounds
    check; None: no array, False), answered without it where both arrays own their memory:
    two buffers numpy allocated apart never overlap (0.05 us against 0.3; this runs for
    every two-phase call and blocking call)."""
    if array is None or (out is not array and out.flags.owndata and array.flags.owndata):
        return False
    return bool(np.may_share_memory(out, array))


def cuts(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, near-equal ranges covering ``range(n)``."""
    return list(itertools.pairwise(n * i // parts for i in range(parts + 1)))


@attrs.frozen
class Parameter:
    """One positional argument of an operator's public call.

    Attributes:
        name: the argument's name (a tensor name of the operator, or a scalar's).
        annotation: its type as written in the generated signatures.
        doc: one line for the generated docstrings.
        default: the source text of its default value; None when it is required.
    """

    name: str
    annotation: str
    doc: str
    default: str | None = None
    #: The default as a value (evaluated once, here: calls never parse anything).
    default_value: Any = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        value = None if self.default is None else ast.literal_eval(self.default)
        object.__setattr__(self, "default_value", value)


#: Scalar types whose value a cached signature may hold as it is.
_PLAIN = frozenset((int, bool, float, str))

#: The array types of which the checks see only shape and dtype: numpy's, and a framework
#: device's tensor type once such a device exists (:func:`register_array_type`). A call of
#: them is known by its shapes and dtypes (:meth:`Operator.call_signature`).
ARRAY_TYPES: set[type] = {np.ndarray}


def register_array_type(kind: type) -> None:
    """Let calls passing ``kind`` arrays (a framework's exact tensor type) be known by
    their shapes and dtypes: a device whose checks see nothing else of them calls this."""
    ARRAY_TYPES.add(kind)


def entry_point(
    fn: Callable[..., Any],
    like: Callable[..., Any],
    name: str,
    doc: str,
    *,
    first: str | None = None,
    keywords: Sequence[str] | None = None,
    returns: str | None = None,
) -> Callable[..., Any]:
    """Give a generic wrapper the look of one operator's entry point (for ``help()``,
    ``inspect.signature`` and docs): ``like``'s signature without its first parameter,
    ``first`` put back in front, only ``keywords`` of its keyword-only parameters kept
    (all when None), and ``returns`` as the return annotation."""
    signature = inspect.signature(like)
    params = list(signature.parameters.values())[1:]
    if keywords is not None:
        params = [p for p in params if p.kind is not p.KEYWORD_ONLY or p.name in keywords]
        params += [
            inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None)
            for k in keywords
            if k not in {p.name for p in params}
        ]
    if first is not None:
        params.insert(0, inspect.Parameter(first, inspect.Parameter.POSITIONAL_ONLY))
    returned = signature.return_annotation if returns is None else returns
    fn.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=returned
    )
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


class Operator(abc.ABC):
    """An operator description: one instance per operator, stateless.

    A request is a mapping of argument names to arrays (``tensors``) plus scalar arguments
    (``scalars``, e.g. ``dim``). Subclasses describe the public call and define the
    checks, outputs, fusion key, split, tolerance, oracle and example inputs; each device's
    launcher runs it.
    """

    #: The aclnn operator name, e.g. ``"GluBackward"``.
    name: ClassVar[str]
    #: The entry points' name: ``opsched.glu_backward``, ``sched.glu_backward_nowait``,
    #: ``opsched.aclnn.glu_backward_get_workspace_size``, ...
    method: ClassVar[str]
    #: The public call's positional arguments, in order; outputs come as ``out=``.
    parameters: ClassVar[tuple[Parameter, ...]]
    #: What the call computes and returns, one line for the generated docstrings.
    summary: ClassVar[str]
    #: The type of the result (and of ``out=``, which may also be None).
    result_annotation: ClassVar[str] = "np.ndarray"
    out_annotation: ClassVar[str] = "np.ndarray | None"
    #: The type of each output argument of the two-phase call.
    output_annotation: ClassVar[str] = "np.ndarray"
    #: Tensor argument names in signature order; the last ones are ``outputs``.
    tensor_names: ClassVar[tuple[str, ...]]
    #: Output tensor argument names.
    outputs: ClassVar[tuple[str, ...]]
    #: The dtypes it takes (docs/operators.md).
    dtypes: ClassVar[tuple[np.dtype, ...]]
    #: Inputs the kernel still reads while it writes outputs: an output overlapping one of
    #: them must be staged through the workspace.
    overlap_inputs: ClassVar[tuple[str, ...]]
    #: Whether :meth:`split` may cut a request into parts (False: it always runs whole, so
    #: a device need not give a large request its outputs before the launch).
    splits: ClassVar[bool] = True

    def __init__(self) -> None:
        #: What a caller gets back from a request's tensors: the output array (a tuple of
        #: them, in order, for several outputs). A C-level getter: it runs per request.
        self.result: Callable[[Mapping[str, Any]], Any] = operator.itemgetter(*self.outputs)
        #: Input tensor argument names, in signature order (``tensor_names`` before the
        #: outputs).
        self.inputs: tuple[str, ...] = self.tensor_names[
            : len(self.tensor_names) - len(self.outputs)
        ]

    @abc.abstractmethod
    def check(
        self,
        tensors: Mapping[str, Any],
        scalars: Mapping[str, Any],
        *,
        allocate: bool,
        support: OpSupport | None = None,
    ) -> dict[str, Any]:
        """Run the checks of docs/operators.md in order; return the normalised scalars.

        With ``allocate`` the outputs may be None (they will be allocated) and are then not
        checked. ``support``: a product's dtypes for this operator (default: every dtype it takes).

        Raises:
            ParamNullptrError, ParamInvalidError: as docs/operators.md lists, the first
                failing check.
            TypeError: an argument of the wrong kind (not an array, dim not an integer).
        """

    def bind(self, args: Sequence[Any], named: dict[str, Any]) -> tuple[Any, ...]:
        """The public call's positional arguments, completed from ``named`` and the
        defaults, as Python binds a call of the generated signature.

        Raises:
            TypeError: too many positional arguments, a missing or unknown argument, or
                one given twice.
        """
        params = self.parameters
        if len(args) > len(params):
            msg = f"{self.method}() takes {len(params)} arguments but {len(args)} were given"
            raise TypeError(msg)
        for p in params[: len(args)]:
            if p.name in named:
                msg = f"{self.method}() got multiple values for argument {p.name!r}"
                raise TypeError(msg)
        values = list(args)
        for p in params[len(args) :]:
            if p.name in named:
                values.append(named.pop(p.name))
            elif p.default is not None:
                values.append(p.default_value)
            else:
                msg = f"{self.method}() missing required argument {p.name!r}"
                raise TypeError(msg)
        if named:
            msg = f"{self.method}() got an unexpected keyword argument {next(iter(named))!r}"
            raise TypeError(msg)
        return tuple(values)

    def call_signature(self, args: Sequence[Any]) -> Hashable | None:
        """What the checks of a call with these positional arguments (and no outputs)
        depend on: each array's shape and dtype, each scalar's value; None when an argument
        is neither an array of :data:`ARRAY_TYPES` nor a plain scalar (then nothing is
        cached). The key of :meth:`call_tensors`."""
        return self.call_tensors(args, None)[0]

    def call_tensors(
        self, args: Sequence[Any], out: Any
    ) -> tuple[Hashable | None, dict[str, Any] | None]:
        """A positional call's :meth:`call_signature` and, where it has one, its tensors
        (:meth:`arguments`' first dict, ``out`` bound): one step on a repeated call's hot
        path, which looks the key up and then needs the tensors of its request. Each
        operator's generated version reads its own parameters; this generic one keys each
        argument by kind. ``(None, None)``: not cached (so a call :meth:`arguments` refuses,
        which the full checks then refuse with its error)."""
        call = self._generic_call_signature(args)
        if call is None:
            return None, None
        try:
            return call, self.arguments(args, out)[0]
        except TypeError:  # a wrong count, or outputs that are no tuple of them
            return None, None

    def _generic_call_signature(self, args: Sequence[Any]) -> Hashable | None:
        """The key of :meth:`call_tensors` for any operator: the operator's name and each
        argument by kind; None for an argument of no cached kind."""
        parts: list[Any] = [self.name]
        for value in args:
            kind = type(value)
            if kind in ARRAY_TYPES:
                parts.append((value.shape, value.dtype))
            elif (
                value is None
                or kind in _PLAIN
                or (kind is tuple and all(type(v) in _PLAIN for v in value))
            ):
                parts.append((kind, value))
            else:
                return None
        return tuple(parts)

    def arguments(self, args: Sequence[Any], out: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """A public call's ``(tensors, scalars)``: positional ``args`` in the order of
        :attr:`parameters` (trailing ones may be left to their defaults), ``out`` the
        output (a tuple of them for several outputs).

        Raises:
            TypeError: a wrong number of arguments, or ``out`` neither None nor a tuple of
                one entry per output.
        """
        tensors: dict[str, Any] = {}
        scalars: dict[str, Any] = {}
        names = self.tensor_names
        if len(args) != len(self.parameters):
            args = self.bind(args, {})
        for parameter, value in zip(self.parameters, args, strict=True):
            (tensors if parameter.name in names else scalars)[parameter.name] = value
        outputs = self.outputs
        if len(outputs) == 1:
            tensors[outputs[0]] = out
            return tensors, scalars
        if out is None:
            out = (None,) * len(outputs)
        elif not isinstance(out, tuple | list) or len(out) != len(outputs):
            msg = f"{self.name}: out must be a ({', '.join(outputs)}) tuple or None, got {out!r}"
            raise TypeError(msg)
        tensors.update(zip(outputs, out, strict=True))
        for name in self.unasked_outputs(scalars):
            tensors[name] = None
        return tensors, scalars

    def unasked_outputs(self, scalars: Mapping[str, Any]) -> tuple[str, ...]:
        """The outputs a call's scalars turn off (default: none). An array given for one
        is not the request's: never written, and its entry of the result is None."""
        return ()

    @abc.abstractmethod
    def output_spec(
        self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``name -> (shape, dtype)`` of each output of a checked request."""

    def allocate(self, tensors: dict[str, Any], scalars: Mapping[str, Any]) -> None:
        """Put new, C-contiguous arrays in ``tensors`` for the outputs of a checked request
        that the caller did not give (None there)."""
        for name, (shape, dtype) in self.output_spec(tensors, scalars).items():
            if tensors[name] is None:
                tensors[name] = np.empty(shape, dtype)

    def tolerance(self, dtype: np.dtype) -> tuple[float, float]:
        """``(rtol, atol)`` a result in ``dtype`` keeps against the float64 :meth:`oracle`
        (docs/operators.md, "Tolerances"): the vendor's, per dtype."""
        return self.tolerances[np.dtype(dtype)]

    #: :meth:`tolerance`'s table; an operator with a tighter one for a dtype overrides it.
    tolerances: ClassVar[Mapping[np.dtype, tuple[float, float]]] = {
        np.dtype(np.float64): (1e-10, 1e-10),
        np.dtype(np.float32): (1e-4, 1e-4),
        np.dtype(np.float16): (1e-2, 1e-3),
        np.dtype(ml_dtypes.bfloat16): (2e-2, 2e-3),
    }

    @abc.abstractmethod
    def oracle(self, *args: Any) -> Any:
        """The float64 result of a positional call (its parameters, in order): the formula
        of docs/operators.md from the inputs' exact values, written independently of the
        kernels (the tests' and the stress harness's expectation); a tuple, None where an
        output is not asked for, for several outputs."""

    @abc.abstractmethod
    def example(self, rng: np.random.Generator, dtype: Any = np.float32) -> tuple[Any, ...]:
        """A positional call of tiny example inputs in ``dtype`` (the benchmarks' per-request
        workload: a few KiB), random from ``rng``."""

    def check_on(
        self,
        product: Product,
        tensors: Mapping[str, Any],
        scalars: Mapping[str, Any],
        *,
        allocate: bool,
    ) -> dict[str, Any]:
        """:meth:`check` as ``product``'s runtime would: 561003 when the product lacks the
        operator, then the checks with the product's dtypes."""
        support = check_product(product, self.name)
        checked = self.check(tensors, scalars, allocate=allocate, support=support)
        check_writable(self.name, self.outputs, tensors)
        return checked

    def allowed_dtypes(self, support: OpSupport | None) -> tuple[tuple[np.dtype, ...], str]:
        """The dtypes a request may have, and the product whose list it is."""
        if support is None or support.product == "generic":
            return self.dtypes, "generic"
        return tuple(DTYPES_BY_NAME[n] for n in support.dtypes), support.product

    def signature(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]) -> Hashable | None:
        """What the checks depend on: each tensor's shape and dtype (None when absent) and
        each scalar's type and value; None when an argument is not exactly an ndarray or a
        scalar cannot be hashed (a list, or a tuple holding one)."""
        arrays = shapes_and_dtypes([tensors[name] for name in self.tensor_names])
        if arrays is None:
            return None
        parts: list[Any] = [self.name, *arrays]
        for value in scalars.values():
            if type(value) is list:  # a sequence given as a list: the same checks
                value = tuple(value)
            parts.append((type(value), value))
        key = tuple(parts)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def overlaps_any(self, tensors: Tensors) -> bool:
        """True when an output may share memory with an input the kernel reads."""
        for name in self.outputs:
            out = tensors[name]
            if out is not None:
                for input_name in self.overlap_inputs:
                    if may_overlap(out, tensors[input_name]):
                        return True
        return False

    # ---------------------------------------------------------------- fusion and splitting
    #
    # A fused launch gathers many requests of one fusion key into contiguous arrays of a
    # bucketed capacity (the fused geometry), runs the operator's own kernel on them once, and
    # scatters each request's slice of the output back. Each element or group is computed by
    # the same float operations on the same contiguous buffers as when launched alone, so the
    # results are bit-identical.

    @abc.abstractmethod
    def fusion(self, tensors: Tensors, scalars: Mapping[str, Any]) -> tuple[Hashable, int]:
        """``(key, units)``: requests with equal keys fuse; ``units`` is a request's share
        of a fused launch's capacity (elements for GLU, groups for group norm)."""

    @abc.abstractmethod
    def split(
        self, tensors: Tensors, scalars: Mapping[str, Any], parts: int
    ) -> list[tuple[dict[str, np.ndarray], dict[str, Any]]] | None:
        """Views of one request cut into up to ``parts`` independent launches, or None when
        its layout does not allow it (operands not viewable, output overlapping input)."""

    def nbytes(self, tensors: Tensors) -> int:
        """Bytes a request reads and writes (inputs plus outputs)."""
        return sum(tensors[name].nbytes for name in self.tensor_names)
