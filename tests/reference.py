"""An independent float64 NumPy reference of lookups and sparse optimizer steps.

Written from API.md's formulas, sharing no code with the library: tables are logical (V, D)
arrays, features are (ids (B, L), weights (B, L) or None) with -1 padding.
"""

from __future__ import annotations

import numpy as np


def _valid(ids, vocab):
    return (ids >= 0) & (ids < vocab)


def combine_scale(ids, weights, vocab, combiner, sequence):
    ids = np.asarray(ids).reshape(len(ids), -1)
    valid = _valid(ids, vocab)
    w = (
        np.ones(ids.shape)
        if weights is None
        else np.asarray(weights, np.float64).reshape(ids.shape)
    )
    w = np.where(valid, w, 0.0)
    if sequence or combiner == "sum":
        return ids, valid, w
    if combiner == "mean":
        d = w.sum(1, keepdims=True)
    else:
        d = np.sqrt((w * w).sum(1, keepdims=True))
    return ids, valid, np.divide(w, d, out=np.zeros_like(w), where=d != 0)


def lookup(table, ids, weights, combiner, max_sequence_length=0):
    """(B, D) or (B, L, D) float64 activations."""
    table = np.asarray(table, np.float64)
    vocab = table.shape[0]
    ids = np.asarray(ids).reshape(len(ids), -1)
    if weights is not None:
        weights = np.asarray(weights).reshape(ids.shape)
    if max_sequence_length:
        ids, weights = _fit_sequence(ids, weights, max_sequence_length)
    ids, valid, scale = combine_scale(ids, weights, vocab, combiner, max_sequence_length > 0)
    rows = table[np.where(valid, ids, 0)] * scale[..., None]
    return rows if max_sequence_length else rows.sum(1)


def _fit_sequence(ids, weights, length):
    b, l = ids.shape
    if l >= length:
        return ids[:, :length], None if weights is None else weights[:, :length]
    pad = np.full((b, length - l), -1)
    ids = np.concatenate([ids, pad], 1)
    if weights is not None:
        weights = np.concatenate([weights, np.zeros((b, length - l))], 1)
    return ids, weights


def row_gradients(vocab, contributions):
    """{row: summed (D,) gradient} from a list of (ids, weights, combiner, seq_len, grad)."""
    out: dict[int, np.ndarray] = {}
    for ids, weights, combiner, seq_len, grad in contributions:
        ids = np.asarray(ids).reshape(len(ids), -1)
        if weights is not None:
            weights = np.asarray(weights).reshape(ids.shape)
        if seq_len:
            ids, weights = _fit_sequence(ids, weights, seq_len)
        ids, valid, scale = combine_scale(ids, weights, vocab, combiner, seq_len > 0)
        grad = np.asarray(grad, np.float64)
        for b, l in zip(*np.nonzero(valid)):
            g = grad[b, l] if seq_len else grad[b]
            out.setdefault(int(ids[b, l]), np.zeros(grad.shape[-1]))
            out[int(ids[b, l])] = out[int(ids[b, l])] + scale[b, l] * g
    return out


def optimizer_step(name, hp, w, slots, g, lr):
    """One row update in float64. Returns (new_w, new_slots)."""
    s = {k: np.array(v, np.float64) for k, v in slots.items()}
    if name == "sgd":
        return w - lr * g, s
    if name == "adagrad":  # epsilon 0: TF's; > 0: FBGEMM's EXACT_ADAGRAD, torch's.
        a = s["accumulators"] + g * g
        return w - lr * g / (np.sqrt(a) + hp.get("epsilon", 0.0)), {"accumulators": a}
    if name == "adagrad_momentum":
        a = s["accumulators"]
        a = a + g * g if hp["beta2"] == 1 else hp["beta2"] * a + (1 - hp["beta2"]) * g * g
        sc = g * (a + hp["epsilon"]) ** (-1.0 / hp["exponent"])
        m = hp["momentum"] * s["momenta"] + sc
        upd = hp["momentum"] * m + sc if hp["use_nesterov"] else m
        return w - lr * upd, {"accumulators": a, "momenta": m}
    if name == "adam":
        m = hp["beta_1"] * s["momenta"] + (1 - hp["beta_1"]) * g
        v = hp["beta_2"] * s["velocities"] + (1 - hp["beta_2"]) * g * g
        if hp["sum_inside_sqrt"]:
            upd = m / np.sqrt(v + hp["epsilon"] ** 2)
        else:
            upd = m / (np.sqrt(v) + hp["epsilon"])
        return w - lr * upd, {"momenta": m, "velocities": v}
    if name == "ftrl":
        p = -hp["learning_rate_power"]
        n, z = s["accumulators"], s["linears"]
        n2 = n + g * g
        l1, l2, beta = hp["l1"], hp["l2"], hp["beta"]
        if hp["multiply_linear_by_learning_rate"]:
            z = z + lr * g - (n2**p - n**p) * w
            new = np.where(
                np.abs(z) <= l1 * lr, 0.0, (np.sign(z) * l1 * lr - z) / (n2**p + beta + 2 * l2 * lr)
            )
        else:
            z = z + g - (n2**p - n**p) / lr * w
            new = np.where(
                np.abs(z) <= l1, 0.0, (np.sign(z) * l1 - z) / ((n2**p + beta) / lr + 2 * l2)
            )
        return new, {"accumulators": n2, "linears": z}
    if name == "momentum":  # TF's ApplyMomentum.
        m = hp["momentum"] * s["momenta"] + g
        upd = g + hp["momentum"] * m if hp["use_nesterov"] else m
        return w - lr * upd, {"momenta": m}
    if name == "rmsprop":  # TF's ApplyRMSProp / ApplyCenteredRMSProp.
        rho = hp["rho"]
        ms = s["ms"] + (g * g - s["ms"]) * (1 - rho)
        out = {"ms": ms}
        denom = ms + hp["epsilon"]
        if hp["centered"]:
            mg = s["mg"] + (g - s["mg"]) * (1 - rho)
            denom = ms - mg * mg + hp["epsilon"]
            out["mg"] = mg
        mom = hp["momentum"] * s["mom"] + lr * g / np.sqrt(denom)
        out["mom"] = mom
        return w - mom, out
    if name == "proximal_adagrad":  # TF's ApplyProximalAdagrad.
        a = s["accumulators"] + g * g
        eta = lr / np.sqrt(a)
        p = w - eta * g
        p = np.sign(p) * np.maximum(np.abs(p) - eta * hp["l1"], 0.0)
        return p / (1 + eta * hp["l2"]), {"accumulators": a}
    if name == "optax_adam":  # optax.adam with one count per row (lazy, bias-corrected).
        b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
        c = s["0_count"] + 1
        m = b1 * s["0_mu"] + (1 - b1) * g
        v = b2 * s["0_nu"] + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**c), v / (1 - b2**c)
        return w - lr * m_hat / (np.sqrt(v_hat) + eps), {"0_count": c, "0_mu": m, "0_nu": v}
    if name == "momentum_custom":  # tests/test_optimizers.py's CustomOptimizer.
        v = hp["beta"] * s["velocity"] + g
        return w - lr * v, {"velocity": v, "count": s["count"] + 1.0}
    if name == "rowwise_adagrad":
        a = s["accumulators"] + np.mean(g * g)
        return w - lr * g / (np.sqrt(a) + hp["epsilon"]), {"accumulators": a}
    raise ValueError(name)


def apply(
    name,
    hp,
    table,
    slots,
    grads_by_row,
    lr,
    *,
    multiplier=1.0,
    clipping_limit=None,
    clipvalue=None,
    weight_decay=None,
    decay_by_lr=False,
    clip_min=None,
    clip_max=None,
    dense=False,
):
    """Updates a logical table and its slots; untouched rows are copied through."""
    table = np.array(table, np.float64)
    slots = {k: np.array(v, np.float64) for k, v in slots.items()}
    rows = sorted(grads_by_row) if not dense else range(table.shape[0])
    for r in rows:
        g = grads_by_row.get(r, np.zeros(table.shape[1])) * multiplier
        if clipping_limit is not None:
            g = np.clip(g, -clipping_limit, clipping_limit)
        if clipvalue is not None:
            lo, hi = clipvalue if isinstance(clipvalue, (tuple, list)) else (-clipvalue, clipvalue)
            g = np.clip(g, lo, hi)
        w = table[r]
        new, new_slots = optimizer_step(name, hp, w, {k: v[r] for k, v in slots.items()}, g, lr)
        if weight_decay:
            new = new - (lr * weight_decay if decay_by_lr else weight_decay) * w
        if clip_min is not None or clip_max is not None:
            new = np.clip(new, clip_min, clip_max)
        table[r] = new
        for k, v in new_slots.items():
            slots[k][r] = v
    return table, slots
