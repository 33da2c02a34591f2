"""The model's matrix products, by the names of their weights: what the model computes (`model.py`) and what a
backend prepares and runs (`ops.py`, `backends/`) both read them here.

QKV and GATE_UP: the products that share an input, as the model computes them; a backend may run each group as one
product (`Ops.project`, `Ops.gated`). ROTATED: those whose outputs the rotary embedding turns (`Ops.rope_halves`).
PRODUCT_IN_DIMS: every product's weight, by its name in a layer's params (or the model's, for the output layer), and
the trailing dims it contracts (`Ops.linear`'s in_dims).
"""

QKV = ("wq", "wk", "wv")
ROTATED = ("wq", "wk")  # whose outputs the rotary embedding rotates
GATE_UP = ("w1", "w3")
PRODUCT_IN_DIMS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w1": 1, "w2": 1, "w3": 1, "output": 1}
