"""Exceptions raised by onnxgrad."""


class NotDifferentiableError(NotImplementedError):
    """An op on a path from a y to an x has no gradient rule.

    Raised with the op type, domain, opset, node name and the path, so the fix
    (a rule, or the tensor to pass in ``stop_gradients``) is obvious.
    """

    def __init__(self, op_type, domain, opset, node_name, path):
        self.op_type, self.domain, self.opset, self.node_name, self.path = (
            op_type, domain, opset, node_name, list(path))
        dom = domain or "ai.onnx"
        route = " -> ".join(self.path) if self.path else "?"
        super().__init__(
            f"no gradient rule for op {op_type!r} (domain {dom!r}, opset {opset}) at node "
            f"{node_name!r}, which lies on the path {route}. If this input should be held "
            f"constant, pass one of the tensors on that path in stop_gradients.")


class DistributedError(RuntimeError):
    """Data-parallel training cannot go on: a rank died or hung (the message names it), the ranks
    disagree (model, data, checkpoint), or the process group could not be formed."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""
