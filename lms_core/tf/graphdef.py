"""What every GraphDef rewrite here shares: how GraphDef inputs name tensors, and the attribute that
keeps Grappler from removing or folding an op a rewrite depends on."""
from __future__ import annotations

# Grappler leaves a node with this attribute alone: without it, the arithmetic optimizer rewrote 9 of
# a small ResNet-50's 582 swap-in triggers away (`Add(x, Neg(y))` into `Sub`).
KEEP_ATTR = "_grappler_do_not_remove"


def graphdef_ref(tensor: str) -> str:
    """`op:0` -> `op`, `op:2` -> `op:2`: how GraphDef inputs name tensors."""
    op, _, index = tensor.rpartition(":")
    return op if index == "0" else tensor
