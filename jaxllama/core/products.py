"""The model's matrix products, by the names of their weights: what the model computes (`model.py`) and what a
backend prepares and runs (`ops.py`, `backends/`) both read them here.

QKV and GATE_UP: the products that share an input, as the model computes them; a backend may run each group as one
product (`Ops.project`, `Ops.gated`). ROTATED: those whose outputs the rotary embedding turns (`Ops.rope_halves`).
BIASES and HEAD_NORMS: the parameters that are laid out by head dims like the rotated products' outputs.
PRODUCT_IN_DIMS: every product's weight, by its name in a layer's params (or the model's, for the output layer), and
the trailing dims it contracts (`Ops.linear`'s in_dims).
"""

QKV = ("wq", "wk", "wv")
ROTATED = ("wq", "wk")  # whose outputs the rotary embedding rotates
BIASES = ("bq", "bk", "bv")  # of QKV's products, in a family that has them (Qwen2)
ROTATED_BIASES = BIASES[:2]
HEAD_NORMS = ("q_norm", "k_norm")  # per-head RMSNorms of the rotated outputs, in a family that has them (Qwen3)
GATE_UP = ("w1", "w3")
PRODUCT_IN_DIMS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w1": 1, "w2": 1, "w3": 1, "output": 1}
