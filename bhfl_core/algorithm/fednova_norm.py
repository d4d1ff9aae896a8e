"""FedNova's ``||a_i||_1``: how many steps' worth of gradient a client's execution adds up to (Wang et al. 2020).

FedNova writes a client's update as ``x_ref - x_i = eta * sum_k a_ik g_ik``, its
gradients ``g_ik`` weighted by ``a_i``, and divides it by ``||a_i||_1``
(``fednova_rule.py``). The weights depend on the local optimiser:

- **SGD with FedProx's ``mu > 0``** (``learning/local_train.py``: constant ``lr`` = eta,
  no momentum, ``mu·(p - p0)`` added to the gradient before the step, ``p0`` the
  parameters the TRAIN call started from). One call of ``s`` steps:
  ``x_{k+1} - p0 = (1 - alpha)(x_k - p0) - eta g_k`` with ``alpha = eta·mu``, so
  ``x_s - p0 = -eta sum_{k<s} (1 - alpha)^(s-1-k) g_k``: ``a = [(1-alpha)^(s-1), ..., 1-alpha, 1]``,
  ``||a||_1 = sum_{k<s} (1 - alpha)^k = (1 - (1 - alpha)^s) / alpha`` (the paper's FedProx case;
  its reference implementation, github JYWa/FedNova ``FedNova.step``, accumulates it step by
  step: ``v = v·(1 - etamu) + 1``). A client's execution is ``rounds`` TRAIN calls, each
  re-anchored at its own start (the first: the model it received, which is ``x_ref``:
  ``config/step_normalised_starts.py``), so its update is the sum of theirs and ``a_i`` is
  ``rounds`` copies of ``a``: ``||a_i||_1 = rounds · (1 - (1 - alpha)^s) / alpha``, ``s``
  the call's steps (``tree.call_steps``). Weight decay is part of
  ``g_k`` (SGD adds ``weight_decay·p`` to the gradient, the reference implementation too):
  the gradient of the client's regularised objective, not a pull towards ``p0``.
- **Plain SGD** (``mu = 0``): ``a_i`` is all ones, ``||a_i||_1 = tau_i``, the steps.
- **AdamW**: the paper has no normaliser for adaptive optimisers; ``tau_i`` is used, the
  vanilla-SGD one.

A pure function of the tree, like ``tree.local_steps``: a client handed back from its
checkpoint (a retried batch) reports the same number as one that trained. Computed with
IEEE additions and multiplications only (the geometric sum by doubling, no ``pow``), so
every machine gets the same bits, and without the cancellation of ``1 - (1 - alpha)^s``
when ``alpha·s`` is small.
"""

from __future__ import annotations

from bhfl_core.algorithm.tree import Node, call_steps, local_steps


def proximal_norm(alpha: float, steps: int) -> float:
    """``sum_{k<steps} (1 - alpha)^k``: ``||a||_1`` of ``steps`` proximal SGD steps with ``alpha = lr·mu`` in (0, 1).

    By doubling over ``steps``'s bits, ``G(2m) = G(m)(1 + q^m)`` and ``G(m + 1) = 1 + q G(m)``
    (``q = 1 - alpha``): every term positive, ``O(log steps)`` correctly rounded operations.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"the proximal normaliser needs 0 < lr·mu < 1, got {alpha}")
    if steps < 0:
        raise ValueError(f"a negative step count: {steps}")
    q, total, power = 1.0 - alpha, 0.0, 1.0  # G(m), q^m for m = 0
    for bit in bin(steps)[2:] if steps else "":
        total, power = total * (1.0 + power), power * power  # m -> 2m
        if bit == "1":
            total, power = 1.0 + q * total, q * power  # m -> m + 1
    return total


def local_norm(node: Node, epochs: int | None = None) -> float:
    """FedNova's ``||a_i||_1`` for a client's execution (module docstring); ``epochs``: its plan's (Tempo).

    ``rounds · sum_{k<s} (1 - lr·mu)^k`` for ``sgd`` with ``mu > 0`` (``s`` its TRAIN calls'
    steps), else ``tree.local_steps`` (plain SGD exactly, AdamW by convention). 0 for a node
    that does not train.
    """
    params = node.settings.train
    if params is None or params.optimizer != "sgd" or params.mu == 0:
        return float(local_steps(node, epochs))
    return node.settings.rounds * proximal_norm(params.lr * params.mu, call_steps(node, epochs))
