"""Loss helpers: attach a scalar loss to one output of a model.

Each helper returns a new ModelProto (the input is never mutated) with one more graph input, the
target (its batch dim symbolic), and one more graph output, the scalar loss, appended after the
model's own outputs. The definitions follow PyTorch's:

    mse            mean((y - t)^2)                                  torch.nn.functional.mse_loss
    l1             mean(|y - t|)                                    torch.nn.functional.l1_loss
    cross_entropy  SoftmaxCrossEntropyLoss(logits [N, C, ...], int64 labels [N, ...]) with optional
                   class weights and ignore_index ("mean": sum(w_i l_i) / sum(w_i))
                                                                    torch.nn.functional.cross_entropy
    bce            max(x, 0) - x t + log(1 + exp(-|x|)) (the stable form), optional pos_weight
                                                                    binary_cross_entropy_with_logits

``reduction`` is "mean" (the default) or "sum". Constants (class weights, pos_weight) are Constant
nodes, not initializers, so they are never mistaken for trainable parameters.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import DataError, InvalidArgumentError
from ..inference import FLOAT_TYPES, taken_names, unique_name
from ..storage import EXTERNAL_DATA_ABOVE, dense_copy, load_model, tensor_nbytes
from ..versions import convert_version

LOSSES = ("mse", "l1", "cross_entropy", "bce")


def load(model) -> onnx.ModelProto:
    """A private copy of ``model`` (a ModelProto or a path), its sparse tensors made dense (a
    trained weight is dense after its first update)."""
    if not isinstance(model, onnx.ModelProto):
        model = load_model(model)
    dense, _ = dense_copy(model)
    if dense is not model:
        return dense
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # not SerializeToString: that fails past 2 GB
    return copy


def check_labels(labels, classes: int | None, ignore_index: int | None = None,
                 name: str = "target") -> np.ndarray:
    """Class labels as int64, or a :class:`DataError` naming the first bad label and its row:
    a fraction or NaN (never truncated), a negative label (never wrapped around), or one of
    ``classes`` or more; ``ignore_index`` is always allowed. ``classes`` None: not known yet."""
    a = np.asarray(labels)
    if a.dtype.kind not in "iuf" or a.dtype == np.bool_:
        raise DataError(f"{name}: class labels must be integers, not {a.dtype} values")

    with np.errstate(invalid="ignore"):
        frac = (~np.isfinite(a) | (a != np.round(a))) if a.dtype.kind == "f" else \
            np.zeros(a.shape, bool)
        keep = frac | (a == ignore_index if ignore_index is not None else False)
        neg = (a < 0) & ~keep
        big = (a >= classes) & ~keep if classes is not None else np.zeros(a.shape, bool)
    bad = frac | neg | big
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        where = f"row {idx[0]}" + (f" (index {list(idx)})" if len(idx) > 1 else "")
        why = ("is not a whole number (class labels are integers; a float label is never "
               "truncated)" if frac[idx] else
               "is negative" + ("" if ignore_index is None else
                                f" and not ignore_index ({ignore_index})") if neg[idx] else
               f"is out of range: the model has {classes} classes (labels 0 to {classes - 1})")
        raise DataError(f"{name}: label {a[idx].item()!r} at {where} {why}")
    return a.astype(np.int64, copy=False)


def opset_of(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def output_type(model: onnx.ModelProto, name: str) -> onnx.TypeProto:
    """The type of ``name``: a graph output's declared type, or else what shape inference gives
    a value inside the graph (an error naming the outputs where there is none)."""
    for v in model.graph.output:
        if v.name == name and v.type.tensor_type.elem_type:
            return v.type
    inferred = onnx.shape_inference.infer_shapes(model)
    for v in [*inferred.graph.output, *inferred.graph.value_info]:
        if v.name == name:
            return v.type
    outs = [o.name for o in model.graph.output]
    raise InvalidArgumentError(f"no output named {name!r} in the model (its outputs: {outs})")


def _target_dims(dims, drop_axis=None):
    """The target's dims: the output's, with a symbolic batch dim (and one axis dropped)."""
    out = []
    for i, d in enumerate(dims):
        if i == drop_axis:
            continue
        if i == 0:
            out.append(d.dim_param if d.HasField("dim_param") else "batch")
        elif d.HasField("dim_value"):
            out.append(d.dim_value)
        elif d.HasField("dim_param"):
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


# the producer_name of the models onnxgrad's TensorFlow converter writes (channels last)
TF_PRODUCER = "onnxgrad.converters.tensorflow"


def class_axis_of(model: onnx.ModelProto, class_axis: int | None = None) -> int:
    """The axis of the cross_entropy logits that holds the classes: ``class_axis`` (1, PyTorch's
    and ONNX's, or -1, TensorFlow's and Keras's), by default -1 for a model the TensorFlow
    converter wrote (a Keras segmentation net's logits are [N, H, W, C]) and 1 otherwise."""
    if class_axis is None:
        return -1 if model.producer_name == TF_PRODUCER else 1
    if isinstance(class_axis, bool) or class_axis not in (1, -1):
        raise InvalidArgumentError(f"class_axis={class_axis!r}: the classes are on axis 1 "
                                   "(PyTorch's logits [N, C, ...]) or -1 (TensorFlow's [..., C])")
    return class_axis


def _warn_on_probabilities(m: onnx.ModelProto, kind: str, output_name: str) -> None:
    """A logging warning where a loss that takes logits reads probabilities: the output comes
    (through Identities) from a Softmax (cross_entropy) or a Sigmoid (bce), as a Keras model
    ending in ``activation="softmax"`` does. The loss is then that of softmax(probabilities),
    not the probabilities' cross-entropy (Keras warns the same about ``from_logits=True``)."""
    want = {"cross_entropy": "Softmax", "bce": "Sigmoid"}.get(kind)
    if want is None:
        return
    producer = {o: n for n in m.graph.node for o in n.output}
    n, name = producer.get(output_name), output_name
    while n is not None and n.op_type == "Identity":
        n = producer.get(n.input[0])
    if n is not None and n.op_type == want and n.domain in ("", "ai.onnx"):
        logging.getLogger("onnxgrad.training").warning(
            "the %s loss takes logits, and output %r is a %s's output (probabilities): it "
            "trains on %s(probabilities), not on their own cross-entropy; give the %s's "
            "input as the output to train (output_name=%r) or drop the activation",
            kind, name, want, want.lower(), want, n.input[0])


def attach_loss(model, kind: str, output_name: str | None = None, *, target_name: str = "target",
                loss_name: str = "loss", reduction: str = "mean", weight=None,
                ignore_index: int | None = None, pos_weight=None,
                class_axis: int | None = None) -> onnx.ModelProto:
    """Return a copy of ``model`` with a scalar ``loss`` of ``kind`` (one of :data:`LOSSES`)
    computed from the output ``output_name`` (default: the first output) and a new target input.

    The names of the new input and output are ``target_name`` and ``loss_name`` (made unique).
    ``weight`` (class weights [C]), ``ignore_index`` and ``class_axis`` (:func:`class_axis_of`)
    are for cross_entropy; ``pos_weight`` ([C] or a scalar) for bce."""
    if kind not in LOSSES:
        raise InvalidArgumentError(f"loss={kind!r} is not one of {', '.join(map(repr, LOSSES))}")
    if reduction not in ("mean", "sum"):
        raise InvalidArgumentError(f"reduction={reduction!r} is not one of 'mean', 'sum'")
    if kind != "cross_entropy" and (weight is not None or ignore_index is not None or
                                    class_axis is not None):
        raise InvalidArgumentError("weight, ignore_index and class_axis apply to the "
                                   "cross_entropy loss only")
    if pos_weight is not None and kind != "bce":
        raise InvalidArgumentError("pos_weight applies to the bce loss only")
    if weight is not None:
        weight = np.asarray(weight, np.float64)
        if weight.ndim != 1 or not weight.size:
            raise InvalidArgumentError(f"the cross_entropy weight must be 1-D, one per class; "
                                       f"it has shape {list(weight.shape)}")
    m = load(model)
    if not m.graph.output:
        raise InvalidArgumentError("the model has no outputs")
    output_name = output_name or m.graph.output[0].name
    otype = output_type(m, output_name)
    elem = otype.tensor_type.elem_type
    if elem not in FLOAT_TYPES:
        raise InvalidArgumentError(
            f"output {output_name!r} is {TensorProto.DataType.Name(elem)}, not a "
            "float tensor: a loss needs float predictions")
    dims = list(otype.tensor_type.shape.dim) if otype.tensor_type.HasField("shape") else None
    np_dtype = helper.tensor_dtype_to_np_dtype(elem)
    need = 13 if kind == "cross_entropy" else 9  # SoftmaxCrossEntropyLoss; Where (checked)
    if pos_weight is not None and np.size(pos_weight) > 1:
        need = 10  # (its length check slices Shape(y) with Slice's inputs, from opset 10)
    if opset_of(m) < need:
        m = convert_version(m, need)
    g = m.graph
    taken = taken_names(g)
    target = unique_name(target_name, taken)
    loss = unique_name(loss_name, taken)
    nodes: list[onnx.NodeProto] = []

    def tmp(base):
        return unique_name(f"loss/{base}", taken)

    def node(op, inputs, **attrs):
        out = tmp(op)
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def const(value, dtype=np_dtype):
        out = tmp("Constant")
        nodes.append(helper.make_node("Constant", [], [out], name=out,
                                      value=numpy_helper.from_array(np.asarray(value, dtype))))
        return out

    reduce_op = "ReduceMean" if reduction == "mean" else "ReduceSum"

    def reduce_all(x):  # no axes: every axis, whatever the opset's form of axes
        out = node(reduce_op, [x], keepdims=0)
        return out

    def checked(t, shape, check=None):
        """t, checked at run time to have ``shape``: onnxruntime binds a symbolic dim per
        input, so a target of batch 1 beside predictions of batch 4 would broadcast through
        the loss (and SoftmaxCrossEntropyLoss reads past it) silently. A dim that differs is
        -2 in the Reshape target, which then fails, naming the check."""
        same = node("Equal", [node("Shape", [t]), shape])
        target = node("Where", [same, shape, const(-2, np.int64)])
        out = unique_name(check or f"loss/{t}_must_have_the_shape_of_{output_name}", taken)
        nodes.append(helper.make_node("Reshape", [t, target], [out], name=out))
        return out

    y = output_name
    _warn_on_probabilities(m, kind, output_name)
    if kind == "cross_entropy":
        if dims is not None and len(dims) < 2:
            raise InvalidArgumentError(
                f"cross_entropy needs logits [N, C, ...]; {output_name!r} has rank "
                f"{len(dims)}")
        axis = class_axis_of(m, class_axis)
        if axis == -1 and dims is None:
            raise InvalidArgumentError(
                f"cross_entropy over the last axis needs the rank of {output_name!r}, which the "
                "model does not declare (give class_axis=1 if the classes are on axis 1)")
        rank = None if dims is None else len(dims)
        if axis == -1 and rank > 2:  # [N, ..., C] -> [N, C, ...], as the ONNX op reads it
            y = node("Transpose", [y], perm=[0, rank - 1, *range(1, rank - 1)])
        tdims = None if dims is None else _target_dims(dims, drop_axis=1 if axis == 1 else
                                                       rank - 1)
        tin = helper.make_tensor_value_info(target, TensorProto.INT64, tdims)
        ins = [y, target]
        if tdims is not None:  # [N, C, d1 ...] -> [N, d1 ...]
            shape, i64 = node("Shape", [y]), np.int64
            cut = lambda a, b: node("Slice", [shape, const([a], i64), const([b], i64)])  # noqa: E731
            ins[1] = checked(target, node("Concat", [cut(0, 1), cut(2, rank)], axis=0))
        if weight is not None:  # one per class (torch refuses other lengths)
            c = dims[1 if axis == 1 else -1] if dims is not None else None
            if c is not None and c.HasField("dim_value") and c.dim_value != weight.size:
                raise InvalidArgumentError(
                    f"the cross_entropy weight has {weight.size} entries, but {output_name!r} "
                    f"has {c.dim_value} classes: give one per class")
            shape = node("Shape", [ins[0]])
            classes = node("Slice", [shape, const([1], np.int64), const([2], np.int64)])
            ins.append(checked(const(weight), classes,
                               f"loss/weight_must_have_one_entry_per_class_of_{output_name}"))
        attrs = {"reduction": reduction}
        if ignore_index is not None:
            attrs["ignore_index"] = int(ignore_index)
        # log_prob as a second output: the gradient reuses it (on a [N, C, H, W] per-pixel
        # loss, recomputing LogSoftmax over axis 1 cost onnxruntime 2.4 ms of a U-Net's step)
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ins,
                                      [loss, tmp("log_prob")],
                                      name="loss/SoftmaxCrossEntropyLoss", **attrs))
    else:
        tdims = None if dims is None else _target_dims(dims)
        tin = helper.make_tensor_value_info(target, elem, tdims)
        if tdims is not None:
            target = checked(target, node("Shape", [y]))
        if kind == "mse":
            d = node("Sub", [y, target])
            per = node("Mul", [d, d])
        elif kind == "l1":
            per = node("Abs", [node("Sub", [y, target])])
        else:  # bce: relu(x) - x t + softplus(-|x|), or with pos_weight p:
            # (1 - t) x + (1 + (p - 1) t) (softplus(-|x|) + relu(-x))   (PyTorch's form)
            # relu and |x| as Wheres on x >= 0, as TF writes them: the loss is smooth at 0,
            # but the rules take Relu's and Abs's slopes at 0 as 0, which dropped sigmoid(0)
            pos = node("GreaterOrEqual", [y, const(0)]) if opset_of(m) >= 12 else \
                node("Not", [node("Less", [y, const(0)])])
            minus_y = node("Neg", [y])
            relu = node("Where", [pos, y, const(0)])
            neg = node("Where", [pos, minus_y, y])
            # onnxruntime has no float64 Softplus kernel; log(1 + e^z) for z <= 0 is exact to
            # the last place of the loss (e^z <= 1)
            soft = node("Softplus", [neg]) if elem != TensorProto.DOUBLE else \
                node("Log", [node("Add", [const(1), node("Exp", [neg])])])
            if pos_weight is None:
                per = node("Add", [node("Sub", [relu, node("Mul", [y, target])]), soft])
            else:
                pwa = np.asarray(pos_weight, np_dtype)
                static = [d.dim_value if d.HasField("dim_value") else None for d in dims or []]
                if dims is not None and (pwa.ndim > len(static) or any(
                        p != 1 and d is not None and p != d
                        for p, d in zip(pwa.shape[::-1], static[::-1]))):
                    raise InvalidArgumentError(
                        f"pos_weight of shape {list(pwa.shape)} does not broadcast to "
                        f"{output_name!r} of shape {[d or '?' for d in static]}")
                pw = const(pwa)
                if pwa.ndim == 1 and pwa.size > 1:  # one per last-axis element
                    shape = node("Shape", [y])
                    last = node("Slice", [shape, const([-1], np.int64),
                                          const([np.iinfo(np.int64).max], np.int64)])
                    pw = checked(pw, last, f"loss/pos_weight_must_have_the_last_dim_of_"
                                           f"{output_name}")
                one = const(1)
                lw = node("Add", [one, node("Mul", [node("Sub", [pw, one]), target])])
                left = node("Mul", [node("Sub", [one, target]), y])
                right = node("Mul", [lw, node("Add", [soft, node("Where",
                                                                 [pos, const(0), minus_y])])])
                per = node("Add", [left, right])
        nodes.append(helper.make_node(reduce_op, [per], [loss], name=f"loss/{reduce_op}",
                                      keepdims=0))
    g.node.extend(nodes)
    g.input.append(tin)
    g.output.append(helper.make_tensor_value_info(loss, elem, []))
    if sum(map(tensor_nbytes, g.initializer)) < EXTERNAL_DATA_ABOVE:  # past 2 GB it needs a path
        onnx.checker.check_model(m)
    return m


def mse_loss(model, output_name=None, **kw) -> onnx.ModelProto:
    """Mean squared error (``torch.nn.functional.mse_loss``); see :func:`attach_loss`."""
    return attach_loss(model, "mse", output_name, **kw)


def l1_loss(model, output_name=None, **kw) -> onnx.ModelProto:
    """Mean absolute error (``torch.nn.functional.l1_loss``); see :func:`attach_loss`."""
    return attach_loss(model, "l1", output_name, **kw)


def cross_entropy_loss(model, output_name=None, weight=None, ignore_index=None,
                       **kw) -> onnx.ModelProto:
    """Cross-entropy with logits (``torch.nn.functional.cross_entropy``), int64 class labels,
    optional class ``weight`` and ``ignore_index``, the classes on ``class_axis``; see
    :func:`attach_loss`."""
    return attach_loss(model, "cross_entropy", output_name, weight=weight,
                       ignore_index=ignore_index, **kw)


def bce_with_logits_loss(model, output_name=None, pos_weight=None, **kw) -> onnx.ModelProto:
    """Binary cross-entropy with logits (``binary_cross_entropy_with_logits``), float targets in
    [0, 1] of the logits' shape; see :func:`attach_loss`."""
    return attach_loss(model, "bce", output_name, pos_weight=pos_weight, **kw)
