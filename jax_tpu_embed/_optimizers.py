"""Sparse optimizers, each written for ONE row.

Every optimizer, built-in or custom, exposes the same per-row form:

    update_row(gradient, row, slots, learning_rate, hyperparameters) -> (new_row, *new_slots)

`gradient` and `row` are float32 (D,), each slot (D,) or () by its rank, `learning_rate` a
scalar and `hyperparameters` a tuple of scalars. The engine vmaps this over the rows touched
in a step, so built-ins and `CustomOptimizer` share one code path. Formulas follow TensorFlow's
TPU embedding optimizers (optimization_parameters.proto); see API.md section 2.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

Scalar = Any  # float or fn(step) -> scalar


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """One slot variable: `rank` 2 is a (D,) vector per row, rank 1 a scalar per row.

    `low` and `low_open` are the values the optimizer's update is defined for: every value
    > low (`low_open`) or >= low; None: any finite value. Tables and slots restored from
    outside (`restore_tables`, checkpoints) are checked against them: an Adagrad
    accumulator of -1 (or of 0, where the update divides by its square root) turns the row
    into NaN at its next update.
    """

    name: str
    rank: int
    initializer: Any  # float, or fn(key, shape, dtype) called with the logical shape.
    low: float | None = None
    low_open: bool = False


def _check_scalar(
    owner: str,
    field: str,
    value,
    *,
    low=None,
    low_open=False,
    high=None,
    high_open=False,
    allow_callable=False,
):
    if allow_callable and callable(value):
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        kind = "a finite float or fn(step)" if allow_callable else "a finite float"
        raise ValueError(f"{owner}: {field} must be {kind}, got {value!r}.")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(
            f"{owner}: {field} must be {'>' if low_open else '>='} {low}, got {value!r}."
        )
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(
            f"{owner}: {field} must be {'<' if high_open else '<='} {high}, got {value!r}."
        )


def evaluate(value: Scalar, step: jax.Array, what: str = "the value") -> jax.Array:
    """A float, or fn(step) evaluated on the int32 step; always a float32 scalar.

    A function's result must be a real scalar: its shape and dtype are static, so anything
    else is a ValueError at trace time naming `what` (e.g. "table 't': Adagrad
    learning_rate(step)"). Its value is checked by the caller (`step_values_ok`).
    """
    if callable(value):
        value = value(step)
        shape, dtype = jnp.shape(value), jnp.result_type(value)
        if shape != () or not (
            jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
        ):
            raise ValueError(
                f"{what} returned a {dtype} array of shape {shape}; it must return a real "
                f"scalar (shape ()), one value for every row and lane."
            )
    return jnp.asarray(value, jnp.float32)


class Optimizer:
    """Base of every optimizer. Subclasses are frozen dataclasses."""

    learning_rate: Scalar

    def slot_specs(self) -> tuple[SlotSpec, ...]:
        return ()

    def hyperparameter_values(self) -> tuple[Scalar, ...]:
        """Values (floats or fn(step)) evaluated each step and passed to update_row."""
        return ()

    def learning_rate_ok(self, learning_rate: jax.Array) -> jax.Array:
        """Whether a learning rate computed inside jit may be used: finite and >= 0 (0 is
        allowed, as a warmup schedule's first value; a constant must be > 0)."""
        return jnp.isfinite(learning_rate) & (learning_rate >= 0)

    @property
    def dense_update(self) -> bool:
        """True when every row is updated each step (Adam with lazy_adam=False)."""
        return False

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        raise NotImplementedError

    def finish_row(self, new_row, row, learning_rate):
        """TPU-embedding extras applied after the update (decay, weight clipping)."""
        return new_row

    def clip_gradient(self, gradient):
        return gradient


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class _Extras(Optimizer):
    """The TPU-embedding extras every built-in takes."""

    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool = False
    clipvalue: float | tuple[float, float] | None = None

    def _check(self):
        name = type(self).__name__
        for f in dataclasses.fields(self):  # use_nesterov, lazy_adam, centered, ...
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise TypeError(f"{name}: {f.name} must be a bool (True or False), got {value!r}.")
        _check_scalar(
            name, "learning_rate", self.learning_rate, low=0, low_open=True, allow_callable=True
        )
        for field in ("clip_weight_min", "clip_weight_max", "weight_decay_factor"):
            v = getattr(self, field)
            if v is not None:
                _check_scalar(name, field, v, low=0 if field == "weight_decay_factor" else None)
        if (
            self.clip_weight_min is not None
            and self.clip_weight_max is not None
            and self.clip_weight_min > self.clip_weight_max
        ):
            raise ValueError(
                f"{name}: clip_weight_min ({self.clip_weight_min}) must be <= "
                f"clip_weight_max ({self.clip_weight_max})."
            )
        c = self.clipvalue
        if c is not None:
            if isinstance(c, numbers.Real) and not isinstance(c, bool):
                _check_scalar(name, "clipvalue", c, low=0, low_open=True)
            elif (
                isinstance(c, (tuple, list))
                and len(c) == 2
                and all(isinstance(x, numbers.Real) for x in c)
                and c[0] <= c[1]
            ):
                pass
            else:
                raise ValueError(
                    f"{name}: clipvalue must be a float c > 0 (meaning (-c, c)) "
                    f"or a (min, max) pair with min <= max, got {c!r}."
                )

    def clip_gradient(self, gradient):
        c = self.clipvalue
        if c is None:
            return gradient
        low, high = c if isinstance(c, (tuple, list)) else (-c, c)  # _check: Real or pair.
        return jnp.clip(gradient, low, high)

    def finish_row(self, new_row, row, learning_rate):
        if self.weight_decay_factor:
            decay = self.weight_decay_factor
            if self.multiply_weight_decay_factor_by_learning_rate:
                decay = decay * learning_rate
            new_row = new_row - decay * row
        if self.clip_weight_min is not None or self.clip_weight_max is not None:
            new_row = jnp.clip(new_row, self.clip_weight_min, self.clip_weight_max)
        return new_row


@dataclasses.dataclass(frozen=True, eq=False)
class SGD(_Extras):
    """w -= lr * g."""

    learning_rate: Scalar = 0.01

    def __post_init__(self):
        self._check()

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        return (row - learning_rate * gradient,)


@dataclasses.dataclass(frozen=True, eq=False)
class Adagrad(_Extras):
    """a += g²; w -= lr * g / √a with epsilon 0 (TensorFlow's, the default), or
    w -= lr * g / (√a + ε) with epsilon ε > 0 (FBGEMM's EXACT_ADAGRAD, torch.optim.Adagrad).

    With epsilon > 0 the accumulators may start at 0 (FBGEMM's and PyTorch's default)."""

    learning_rate: Scalar = 0.001
    initial_accumulator_value: float = 0.1
    epsilon: float = 0.0

    def __post_init__(self):
        self._check()
        _check_scalar("Adagrad", "epsilon", self.epsilon, low=0)
        _check_scalar(
            "Adagrad",
            "initial_accumulator_value",
            self.initial_accumulator_value,
            low=0,
            # Without epsilon a touched row with a zero gradient computes 0 / √0.
            low_open=self.epsilon == 0,
        )

    def slot_specs(self):
        return (
            SlotSpec(
                "accumulators",
                2,
                self.initial_accumulator_value,
                low=0.0,
                low_open=self.epsilon == 0,
            ),
        )

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        (accumulator,) = slots
        accumulator = accumulator + gradient * gradient
        if self.epsilon == 0:
            return row - learning_rate * gradient * jax.lax.rsqrt(accumulator), accumulator
        denom = jnp.sqrt(accumulator) + self.epsilon
        return row - learning_rate * gradient / denom, accumulator


@dataclasses.dataclass(frozen=True, eq=False)
class AdagradMomentum(_Extras):
    """Adagrad scaled step fed into (Nesterov) momentum; TF's AdagradMomentumParameters."""

    learning_rate: Scalar = 0.001
    momentum: float = 0.0
    use_nesterov: bool = False
    exponent: float = 2.0
    beta2: float = 1.0
    epsilon: float = 1e-10

    def __post_init__(self):
        self._check()
        _check_scalar("AdagradMomentum", "momentum", self.momentum)
        _check_scalar("AdagradMomentum", "exponent", self.exponent, low=0, low_open=True)
        _check_scalar("AdagradMomentum", "beta2", self.beta2, low=0, high=1)
        # The accumulators start at 0: (0 + epsilon) ** (-1 / exponent) needs epsilon > 0.
        _check_scalar("AdagradMomentum", "epsilon", self.epsilon, low=0, low_open=True)

    def slot_specs(self):
        return (SlotSpec("accumulators", 2, 0.0, low=0.0), SlotSpec("momenta", 2, 0.0))

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        accumulator, momentum = slots
        g2 = gradient * gradient
        if self.beta2 == 1.0:
            accumulator = accumulator + g2
        else:
            accumulator = self.beta2 * accumulator + (1.0 - self.beta2) * g2
        scaled = gradient * jnp.power(accumulator + self.epsilon, -1.0 / self.exponent)
        momentum = self.momentum * momentum + scaled
        step = self.momentum * momentum + scaled if self.use_nesterov else momentum
        return row - learning_rate * step, accumulator, momentum


@dataclasses.dataclass(frozen=True, eq=False)
class Adam(_Extras):
    """Adam without bias correction (TPU semantics). lazy_adam=False decays every row."""

    learning_rate: Scalar = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    lazy_adam: bool = True
    sum_inside_sqrt: bool = True

    def __post_init__(self):
        self._check()
        _check_scalar("Adam", "beta_1", self.beta_1, low=0, high=1, high_open=True)
        _check_scalar("Adam", "beta_2", self.beta_2, low=0, high=1, high_open=True)
        _check_scalar("Adam", "epsilon", self.epsilon, low=0, low_open=True)

    @property
    def dense_update(self) -> bool:
        return not self.lazy_adam

    def slot_specs(self):
        return (SlotSpec("momenta", 2, 0.0), SlotSpec("velocities", 2, 0.0, low=0.0))

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        m, v = slots
        m = self.beta_1 * m + (1.0 - self.beta_1) * gradient
        v = self.beta_2 * v + (1.0 - self.beta_2) * gradient * gradient
        if self.sum_inside_sqrt:
            update = m * jax.lax.rsqrt(v + self.epsilon * self.epsilon)
        else:
            update = m / (jnp.sqrt(v) + self.epsilon)
        return row - learning_rate * update, m, v


@dataclasses.dataclass(frozen=True, eq=False)
class FTRL(_Extras):
    """Follow-the-regularized-leader with TF's parametrisation (p = -learning_rate_power)."""

    learning_rate: Scalar = 0.001
    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    multiply_linear_by_learning_rate: bool = False
    allow_zero_accumulator: bool = False

    def __post_init__(self):
        self._check()
        _check_scalar("FTRL", "learning_rate_power", self.learning_rate_power, high=0)
        _check_scalar("FTRL", "l1_regularization_strength", self.l1_regularization_strength, low=0)
        _check_scalar("FTRL", "l2_regularization_strength", self.l2_regularization_strength, low=0)
        _check_scalar("FTRL", "beta", self.beta, low=0)
        _check_scalar(
            "FTRL",
            "initial_accumulator_value",
            self.initial_accumulator_value,
            low=0,
            low_open=not self.allow_zero_accumulator,
        )

    def slot_specs(self):
        return (
            SlotSpec(
                "accumulators",
                2,
                self.initial_accumulator_value,
                low=0.0,
                low_open=not self.allow_zero_accumulator,
            ),
            SlotSpec("linears", 2, 0.0),
        )

    def learning_rate_ok(self, learning_rate):
        # FTRL divides by the learning rate.
        return jnp.isfinite(learning_rate) & (learning_rate > 0)

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        n, z = slots
        p = -self.learning_rate_power
        lr = learning_rate
        n_new = n + gradient * gradient
        n_p, n_new_p = self._power(n, p), self._power(n_new, p)
        l1, l2 = self.l1_regularization_strength, self.l2_regularization_strength
        if self.multiply_linear_by_learning_rate:
            # z is stored multiplied by lr: z' = lr·z.
            z = z + lr * gradient - (n_new_p - n_p) * row
            denom = n_new_p + self.beta + 2.0 * l2 * lr
            threshold = l1 * lr
        else:
            z = z + gradient - (n_new_p - n_p) / lr * row
            denom = (n_new_p + self.beta) / lr + 2.0 * l2
            threshold = l1
        new_row = jnp.where(jnp.abs(z) <= threshold, 0.0, (jnp.sign(z) * threshold - z) / denom)
        return new_row, n_new, z

    def _power(self, x, p):
        if p == 0:
            return jnp.ones_like(x)
        if self.allow_zero_accumulator:
            safe = jnp.where(x > 0, x, 1.0)
            return jnp.where(x > 0, jnp.power(safe, p), 0.0)
        return jnp.power(x, p)


@dataclasses.dataclass(frozen=True, eq=False)
class RowwiseAdagrad(_Extras):
    """One accumulator per row: a += mean(g²); w -= lr * g / (√a + ε) (FBGEMM's
    EXACT_ROWWISE_ADAGRAD)."""

    learning_rate: Scalar = 0.001
    initial_accumulator_value: float = 0.0
    epsilon: float = 1e-8

    def __post_init__(self):
        self._check()
        _check_scalar(
            "RowwiseAdagrad", "initial_accumulator_value", self.initial_accumulator_value, low=0
        )
        _check_scalar("RowwiseAdagrad", "epsilon", self.epsilon, low=0)
        if self.epsilon == 0 and self.initial_accumulator_value == 0:
            # A touched row whose gradient is 0 would compute 0 / (√0 + 0).
            raise ValueError(
                "RowwiseAdagrad: epsilon and initial_accumulator_value are both 0, so a row "
                "with a zero gradient divides by zero; make one of them > 0."
            )

    def slot_specs(self):
        return (
            SlotSpec(
                "accumulators",
                1,
                self.initial_accumulator_value,
                low=0.0,
                low_open=self.epsilon == 0,
            ),
        )

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        (accumulator,) = slots
        accumulator = accumulator + jnp.mean(gradient * gradient)
        return row - learning_rate * gradient / (jnp.sqrt(accumulator) + self.epsilon), accumulator


@dataclasses.dataclass(frozen=True, eq=False)
class Momentum(_Extras):
    """TF's ApplyMomentum: m = k·m + g; w -= lr·m, or with Nesterov w -= lr·(g + k·m).

    TF1's MomentumParameters has no default momentum; 0.9 is the usual choice."""

    learning_rate: Scalar = 0.01
    momentum: float = 0.9
    use_nesterov: bool = False

    def __post_init__(self):
        self._check()
        _check_scalar("Momentum", "momentum", self.momentum, low=0)

    def slot_specs(self):
        return (SlotSpec("momenta", 2, 0.0),)

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        (m,) = slots
        m = self.momentum * m + gradient
        if self.use_nesterov:
            return row - (gradient * learning_rate + m * self.momentum * learning_rate), m
        return row - learning_rate * m, m


@dataclasses.dataclass(frozen=True, eq=False)
class RMSProp(_Extras):
    """TF's ApplyRMSProp (centered: ApplyCenteredRMSProp), slots start at 0:
    ms += (g² - ms)·(1 - rho); [mg += (g - mg)·(1 - rho)];
    mom = momentum·mom + lr·g/√(ms [- mg²] + ε); w -= mom.

    Defaults are tf.compat.v1.train.RMSPropOptimizer's (TF1's RMSPropParameters has none)."""

    learning_rate: Scalar = 0.001
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-10
    centered: bool = False

    def __post_init__(self):
        self._check()
        _check_scalar("RMSProp", "rho", self.rho, low=0, high=1)
        _check_scalar("RMSProp", "momentum", self.momentum, low=0)
        _check_scalar("RMSProp", "epsilon", self.epsilon, low=0, low_open=True)

    def slot_specs(self):
        specs = (SlotSpec("ms", 2, 0.0, low=0.0), SlotSpec("mom", 2, 0.0))
        return specs + (SlotSpec("mg", 2, 0.0),) if self.centered else specs

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        ms, mom, *mg = slots
        ms = ms + (gradient * gradient - ms) * (1.0 - self.rho)
        denom = ms + self.epsilon
        if self.centered:
            mg = [mg[0] + (gradient - mg[0]) * (1.0 - self.rho)]
            denom = ms - mg[0] * mg[0] + self.epsilon
        mom = self.momentum * mom + learning_rate * gradient * jax.lax.rsqrt(denom)
        return (row - mom, ms, mom, *mg)


@dataclasses.dataclass(frozen=True, eq=False)
class ProximalAdagrad(_Extras):
    """TF's ApplyProximalAdagrad: a += g²; η = lr/√a; p = w - η·g;
    w = sign(p)·max(|p| - η·l1, 0)/(1 + η·l2)."""

    learning_rate: Scalar = 0.001
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0

    def __post_init__(self):
        self._check()
        name = "ProximalAdagrad"
        _check_scalar(
            name, "initial_accumulator_value", self.initial_accumulator_value, low=0, low_open=True
        )
        _check_scalar(name, "l1_regularization_strength", self.l1_regularization_strength, low=0)
        _check_scalar(name, "l2_regularization_strength", self.l2_regularization_strength, low=0)

    def slot_specs(self):
        return (
            SlotSpec("accumulators", 2, self.initial_accumulator_value, low=0.0, low_open=True),
        )

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        (accumulator,) = slots
        accumulator = accumulator + gradient * gradient
        eta = learning_rate * jax.lax.rsqrt(accumulator)
        prox = row - gradient * eta
        l1, l2 = self.l1_regularization_strength, self.l2_regularization_strength
        if l1 > 0:
            prox = jnp.sign(prox) * jnp.maximum(jnp.abs(prox) - eta * l1, 0.0)
        return prox / (1.0 + l2 * eta), accumulator


@dataclasses.dataclass(frozen=True, eq=False)
class CustomOptimizer(Optimizer):
    """A user's per-row update, vmapped over the touched rows (TF's CustomOptimizer).

    Args:
        custom_computation: fn(gradient, embedding_table, slot_variables, learning_rate,
            hyperparameters) -> new_row or (new_row, *new_slots), written for ONE row:
            `gradient` and `embedding_table` are (D,), `slot_variables` a list of the row's
            slots ((D,) or () by slot_dims), `learning_rate` a scalar and `hyperparameters`
            a list of scalars.
        learning_rate: A float or fn(step).
        slot_names: Names of the slots (export_slots and checkpoints use them).
        slot_initializers: One per slot: a float or fn(key, shape, dtype) called with the
            logical shape (V, D) or (V,).
        hyperparameters: Floats or fn(step), evaluated each step (traced: no recompiles).
        slot_dims: 1 or 2 per slot (default 2): 2 is a (D,) vector per row, 1 a scalar.
    """

    custom_computation: Callable
    learning_rate: Scalar = 0.01
    # __init__ takes None for each of these and stores a tuple.
    slot_names: Sequence[str] = ()
    slot_initializers: Sequence[Any] = ()
    hyperparameters: Sequence[Scalar] = ()  # TF's attribute, as given.
    slot_dims: Sequence[int] = ()

    def __init__(
        self,
        custom_computation: Callable,
        learning_rate: Scalar = 0.01,
        slot_names: Sequence[str] | None = None,
        slot_initializers: Sequence[Any] | None = None,
        hyperparameters: Sequence[Scalar] | None = None,
        slot_dims: Sequence[int] | None = None,
    ):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("custom_computation", custom_computation)
        set_("learning_rate", learning_rate)
        set_("slot_names", tuple(slot_names) if slot_names is not None else ())
        set_("slot_initializers", tuple(slot_initializers) if slot_initializers is not None else ())
        set_("hyperparameters", tuple(hyperparameters) if hyperparameters is not None else ())
        set_(
            "slot_dims", tuple(slot_dims) if slot_dims is not None else (2,) * len(self.slot_names)
        )
        self._check()

    def _check(self):
        if not callable(self.custom_computation):
            raise TypeError(
                f"CustomOptimizer: custom_computation must be callable, "
                f"got {self.custom_computation!r}."
            )
        _check_scalar("CustomOptimizer", "learning_rate", self.learning_rate, allow_callable=True)
        n = len(self.slot_names)
        if len(set(self.slot_names)) != n or not all(
            isinstance(s, str) and s for s in self.slot_names
        ):
            raise ValueError(
                f"CustomOptimizer: slot_names must be distinct non-empty "
                f"strings, got {list(self.slot_names)}."
            )
        if len(self.slot_initializers) != n:
            raise ValueError(
                f"CustomOptimizer: slot_initializers must have one entry per "
                f"slot name ({n}), got {len(self.slot_initializers)}."
            )
        if len(self.slot_dims) != n or any(d not in (1, 2) for d in self.slot_dims):
            raise ValueError(
                f"CustomOptimizer: slot_dims must list 1 or 2 for each of the "
                f"{n} slots, got {list(self.slot_dims)}."
            )
        for name, init in zip(self.slot_names, self.slot_initializers):
            if not callable(init):
                _check_scalar("CustomOptimizer", f"slot_initializers[{name!r}]", init)
        for i, h in enumerate(self.hyperparameters):
            _check_scalar("CustomOptimizer", f"hyperparameters[{i}]", h, allow_callable=True)

    def slot_specs(self):
        return tuple(
            SlotSpec(n, r, i)
            for n, r, i in zip(self.slot_names, self.slot_dims, self.slot_initializers)
        )

    def hyperparameter_values(self):
        return self.hyperparameters

    def learning_rate_ok(self, learning_rate):
        # As for the constant: any finite value (a custom update may take a negative one).
        return jnp.isfinite(learning_rate)

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        out = self.custom_computation(
            gradient, row, list(slots), learning_rate, list(hyperparameters)
        )
        if not isinstance(out, (tuple, list)):
            out = (out,)
        if len(out) != 1 + len(slots):
            raise ValueError(
                f"CustomOptimizer: custom_computation returned {len(out)} values; expected "
                f"the new row plus one new value per slot ({1 + len(slots)}: "
                f"{['new_row', *self.slot_names]})."
            )
        # Shapes are static: a wrong one would otherwise broadcast into every lane or fail
        # deep inside the update. Written for ONE row: the row is (D,), a slot (D,) or ().
        problems = []
        for what, new, old in zip(
            ["the new row", *(f"slot {n!r}" for n in self.slot_names)], out, [row, *slots]
        ):
            if jnp.shape(new) != jnp.shape(old):
                dims = "" if what == "the new row" else f" (slot_dims {len(jnp.shape(old)) + 1})"
                problems.append(
                    f"{what} has shape {jnp.shape(new)}, expected {jnp.shape(old)}{dims}"
                )
        if problems:
            raise ValueError(
                "CustomOptimizer: custom_computation, written for ONE row, returned "
                + "; ".join(problems)
                + "."
            )
        return tuple(out)


def slot_initial_value(spec: SlotSpec, key, shape, dtype=jnp.float32, table: str = ""):
    """A slot's initial logical value of `shape` ((V, D) or (V,))."""
    if callable(spec.initializer):
        value: Any = spec.initializer(key, shape, dtype)
        if tuple(jnp.shape(value)) != tuple(shape):
            raise ValueError(
                f"Table {table!r}: the initializer of slot {spec.name!r} (slot_dims "
                f"{spec.rank}) returned shape {tuple(jnp.shape(value))}; expected "
                f"{tuple(shape)}, the shape it was called with."
            )
        return jnp.asarray(value, dtype)
    return jnp.full(shape, spec.initializer, dtype)
