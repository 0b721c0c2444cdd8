"""Field validators for algorithm configs: every dataclass field has one, declared per class.

An algorithm config declares ``validators = {field name: Validator}``; ``Algorithm.__post_init__``
(``base.py``) calls ``validate_fields(self)``. A bad value then fails at construction, on the
main thread, as a ``ValueError`` that names the algorithm, the field, the value and what is
allowed, instead of inside a kernel on the communication thread after the first step. A field
without a declared validator (or a validator without its field) is a programming error raised
at the first construction, so a new hyperparameter cannot slip in unchecked.

The validators::

    positive_int(), non_negative_int(), int_in_range(lo, hi), whole_number(lo, hi),
    positive_multiple_of(m), random_seed()
    fraction()                     a number in (0, 1]
    real_at_least(lo), non_negative_real()   finite numbers
    boolean(), one_of(choices), optional(v), chosen_by(field, {value: v})

plus the codecs' limits ``qsgd_levels()``, ``minmax_bits()`` and ``word_aligned_chunk()``. The
plain ones take ``because=`` (why the limit exists, quoted in the message). Integers must be
integers (``True`` and ``2.0`` are refused; NumPy integers are stored as ``int``); real-valued
fields accept integers too, and never NaN or infinity.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping

# Seeds enter ``call_seed``'s int64 words and NumPy/torch generators: non-negative int64.
MAX_SEED = 2 ** 63 - 1


def _same(value):
    return value


@dataclass(frozen=True)
class Validator:
    """One field's rule: ``accepts(value)``, the value to store (``canonical``), and, for tests,
    values just inside (``edges``) and just outside (``outside``) the allowed range."""

    requirement: str  # completes "must be ...": "an integer in [1, 127]"
    accepts: Callable[[Any], bool]
    canonical: Callable[[Any], Any] = _same
    because: str = ""
    edges: tuple = ()
    outside: tuple = ()

    def for_config(self, config) -> "Validator":
        """The rule for this config (a rule that depends on another field picks it here)."""
        return self

    def check(self, config, field: str, value):
        """The value to store, or ``ValueError`` naming algorithm, field, value and range."""
        if not self.accepts(value):
            why = f" ({self.because})" if self.because else ""
            raise ValueError(f"algorithm {_label(config)}: {field}={value!r} is not allowed: "
                             f"it must be {self.requirement}{why}")
        return self.canonical(value)


@dataclass(frozen=True)
class _ChosenBy(Validator):
    """The rule is ``rules[getattr(config, field)]``: a value whose range depends on another
    field (validated before it, in declaration order)."""

    selector: str = ""
    rules: Mapping[Any, Validator] = dataclasses.field(default_factory=dict)

    def for_config(self, config) -> Validator:
        return self.rules[getattr(config, self.selector)].for_config(config)


def _label(config) -> str:
    name = getattr(type(config), "name", "")
    return f"{name!r} ({type(config).__name__})" if name else type(config).__name__


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


def _as_int(value) -> int:
    return int(value)


# -- integers ------------------------------------------------------------------------------------
def int_in_range(lo: int, hi: int | None = None, *, because: str = "") -> Validator:
    """An integer in [lo, hi] (no upper bound when ``hi`` is None)."""
    span = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    return Validator(span, lambda v: _is_int(v) and lo <= v and (hi is None or v <= hi),
                     _as_int, because, edges=(lo,) if hi is None else (lo, hi),
                     outside=(lo - 1,) if hi is None else (lo - 1, hi + 1))


def whole_number(lo: int, hi: int | None = None, *, because: str = "") -> Validator:
    """An integer, or a float with an integral value (4.0), in [lo, hi]; stored as ``int``."""
    rule = int_in_range(lo, hi, because=because)
    return dataclasses.replace(
        rule, requirement=rule.requirement.replace("an integer", "a whole number"),
        accepts=lambda v: ((_is_int(v) or _is_real(v) and float(v).is_integer())
                           and rule.accepts(int(v))),
        outside=rule.outside + (lo + 0.5,))


def positive_int(*, because: str = "") -> Validator:
    return int_in_range(1, because=because)


def non_negative_int(*, because: str = "") -> Validator:
    return int_in_range(0, because=because)


def positive_multiple_of(multiple: int, *, because: str = "") -> Validator:
    """A positive integer multiple of ``multiple``."""
    return Validator(f"a positive multiple of {multiple}",
                     lambda v: _is_int(v) and v > 0 and v % multiple == 0, _as_int, because,
                     edges=(multiple, 32 * multiple), outside=(0, multiple + 1, -multiple))


def random_seed(*, because: str = "") -> Validator:
    return int_in_range(0, MAX_SEED, because=because or "a non-negative int64: the random "
                        "streams are derived from it as 64-bit words")


# -- real numbers --------------------------------------------------------------------------------
def fraction(*, because: str = "") -> Validator:
    """A finite number in (0, 1]."""
    return Validator("a number in (0, 1]", lambda v: _is_real(v) and 0 < v <= 1, _same,
                     because, edges=(1e-9, 1), outside=(0, 1.0001, -0.5))


def real_at_least(lo: float, *, because: str = "") -> Validator:
    """A finite number >= ``lo``."""
    return Validator(f"a finite number >= {lo}", lambda v: _is_real(v) and v >= lo, _same,
                     because, edges=(lo,), outside=(lo - 0.5,))


def non_negative_real(*, because: str = "") -> Validator:
    return real_at_least(0, because=because)


# -- others --------------------------------------------------------------------------------------
def boolean(*, because: str = "") -> Validator:
    return Validator("True or False", lambda v: isinstance(v, bool), _same, because,
                     edges=(True, False), outside=(1, 0))


def one_of(choices, *, because: str = "") -> Validator:
    choices = tuple(choices)
    return Validator("one of " + ", ".join(map(repr, choices)),
                     lambda v: isinstance(v, str) and v in choices, _same, because,
                     edges=choices, outside=("",))


def optional(rule: Validator) -> Validator:
    """None, or a value that ``rule`` accepts."""
    if isinstance(rule, _ChosenBy):  # None must stay allowed whichever rule is chosen
        return dataclasses.replace(rule, rules={key: optional(each)
                                                for key, each in rule.rules.items()})
    return dataclasses.replace(
        rule, requirement=f"None or {rule.requirement}",
        accepts=lambda v: v is None or rule.accepts(v),
        canonical=lambda v: None if v is None else rule.canonical(v),
        edges=(None,) + rule.edges, outside=rule.outside)


def chosen_by(field: str, rules: Mapping[Any, Validator]) -> Validator:
    """The rule of ``rules[config.<field>]``: ranges that depend on another field."""
    return _ChosenBy("a value allowed for the config's " + field, lambda v: False,
                     selector=field, rules=dict(rules))


# -- the codecs' limits (numba_kernels.wire: QSGDFormat, MinMaxFormat, OneBitFormat) -------------
def qsgd_levels() -> Validator:
    return int_in_range(1, 127, because="each value travels as one int8 code, sign x level")


def minmax_bits() -> Validator:
    return int_in_range(1, 8, because="min-max codes are 1 to 8 bits wide")


def word_aligned_chunk() -> Validator:
    return positive_multiple_of(32, because="a chunk's codes fill whole 32-bit words")

# -- the walk ------------------------------------------------------------------------------------
def declared_validators(cls) -> dict[str, Validator]:
    """The class's ``validators`` table (inherited ones included); {} when it declares none."""
    return dict(getattr(cls, "validators", {}) or {})


def validate_fields(config) -> None:
    """Check every dataclass field of ``config`` against its declared validator, in
    declaration order, storing canonical values (``np.int64(4)`` becomes ``4``)."""
    table = declared_validators(type(config))
    names = [f.name for f in dataclasses.fields(config)]
    undeclared = [n for n in names if n not in table]
    stale = sorted(set(table) - set(names))
    if undeclared or stale:
        raise TypeError(f"{type(config).__name__}.validators must name exactly its fields: "
                        f"no validator for {undeclared}, no field for {stale}")
    for name in names:
        value = getattr(config, name)
        kept = table[name].for_config(config).check(config, name, value)
        if kept is not value:
            object.__setattr__(config, name, kept)  # frozen dataclass: set once, here

