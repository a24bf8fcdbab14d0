"""Exceptions raised by onnxgrad."""


class NotDifferentiableError(NotImplementedError):
    """An op on a path from a y to an x has no gradient rule (or none for this use of it).

    Raised with the op type, domain, opset, node name and the path, so the fix
    (a rule, or the tensor to pass in ``stop_gradients``) is obvious. ``reason`` says why an op
    that has a rule cannot be differentiated here.
    """

    def __init__(self, op_type, domain, opset, node_name, path, reason=None):
        self.op_type, self.domain, self.opset, self.node_name, self.path = (
            op_type, domain, opset, node_name, list(path))
        self.reason = reason
        dom = domain or "ai.onnx"
        route = " -> ".join(self.path) if self.path else "?"
        what = (f"no gradient rule for op {op_type!r}" if reason is None else
                f"cannot differentiate op {op_type!r}")
        why = "" if reason is None else f" ({reason})"
        super().__init__(
            f"{what} (domain {dom!r}, opset {opset}) at node {node_name!r}{why}, which lies on "
            f"the path {route}. If this input should be held constant, pass one of the tensors "
            f"on that path in stop_gradients.")


class InvalidModelError(ValueError):
    """The model given is not one onnxgrad can work on: it fails onnx.checker, its opset or IR
    version is newer than the installed onnx knows, or it contradicts itself (a declared shape
    that shape inference disproves). The message names the tensor, node or version at fault."""
