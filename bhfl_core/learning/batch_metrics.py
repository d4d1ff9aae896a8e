"""Metrics of batches of additive statistics: confusion matrices -> accuracy and macro-F1, NLL sums -> perplexity.

Pure torch over a leading batch dimension (one block of statistics per test group), so a
whole evaluation matrix becomes metrics in a few tensor operations. The task kinds name
these functions as their ``TaskMetrics.batch`` (``task_kinds.py``) and ``metrics.py``
applies them to single blocks; this module imports neither, so the two do not import
each other.
"""

from __future__ import annotations

import torch


def classification_batch(confusions: torch.Tensor) -> dict[str, torch.Tensor]:
    """Accuracy and macro-F1 of a batch of confusion matrices ``[n, true, pred]`` (NaN where empty).

    Macro-F1 averages over the classes present in the truth or the predictions of each
    matrix (scikit-learn's convention).
    """
    c = confusions.to(torch.float64)
    tp = torch.diagonal(c, dim1=-2, dim2=-1)
    total = c.sum(dim=(-2, -1))
    true_count, pred_count = c.sum(dim=-1), c.sum(dim=-2)
    present = (true_count + pred_count) > 0
    f1 = 2 * tp / (true_count + pred_count).clamp(min=1)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    return {
        "accuracy": torch.where(total > 0, tp.sum(dim=-1) / total.clamp(min=1), nan),
        "macro_f1": torch.where(
            present.any(dim=-1), (f1 * present).sum(dim=-1) / present.sum(dim=-1).clamp(min=1), nan
        ),
    }


def lm_batch(stats: torch.Tensor) -> dict[str, torch.Tensor]:
    """``stats[n] = [summed NLL over masked tokens, masked-token count]`` -> mean loss and perplexity.

    loss = sum / count (nats per masked token), perplexity = exp(loss); NaN with no tokens.
    """
    s = stats.to(torch.float64)
    count = s[..., 1]
    loss = torch.where(count > 0, s[..., 0] / count.clamp(min=1e-300), torch.tensor(float("nan"), dtype=torch.float64))
    return {"loss": loss, "perplexity": torch.exp(loss)}
