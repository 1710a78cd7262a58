"""Argument checks shared by the pure modules.

Each check returns the value it accepts and otherwise raises a ``ValueError`` that names the
argument, the value given and what is allowed: ``f"{name} must be {allowed}, got {value!r}"``.
``bool`` is never an integer or a number here, although Python makes it an ``int``.

Example:
    >>> check_positive("tp", 4)
    4
    >>> check_positive("tp", True)
    Traceback (most recent call last):
    ...
    ValueError: tp must be a positive integer, got True
"""

from __future__ import annotations

import math

__all__ = ["is_int", "check_int", "check_positive", "check_nonneg", "check_number", "check_finite", "check_choice"]


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer, ``bool`` excluded."""
    return isinstance(value, int) and not isinstance(value, bool)


def _within(value: float, minimum: float | None, maximum: float | None) -> bool:
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def _integers(minimum: int | None, maximum: int | None) -> str:
    if maximum is None:
        named = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}
        return named.get(minimum, f"an integer of at least {minimum}")
    if minimum is None:
        return f"an integer of at most {maximum}"
    return f"an integer in {minimum}..{maximum}"


def check_int(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None, *, allowed: str | None = None
) -> int:
    """``value`` if it is an integer in ``[minimum, maximum]`` (either bound may be left out).

    ``allowed`` replaces the description of the allowed values in the message.

    Example:
        >>> check_int("bucket_bytes", 512, 1024)
        Traceback (most recent call last):
        ...
        ValueError: bucket_bytes must be an integer of at least 1024, got 512
    """
    if is_int(value) and _within(value, minimum, maximum):  # type: ignore[arg-type]
        return value  # type: ignore[return-value]
    raise ValueError(f"{name} must be {allowed or _integers(minimum, maximum)}, got {value!r}")


def check_positive(name: str, value: object) -> int:
    """``value`` if it is an integer of at least 1."""
    return check_int(name, value, 1)


def check_nonneg(name: str, value: object) -> int:
    """``value`` if it is an integer of at least 0."""
    return check_int(name, value, 0)


def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
    finite: bool = False,
    allowed: str | None = None,
) -> float:
    """``value`` (an ``int`` or a ``float``, as given) if it lies in ``[minimum, maximum]``, is
    above 0 when ``positive`` and finite when ``finite``. NaN is never accepted with a bound.

    Example:
        >>> check_number("blend eta", 1.5, minimum=0, maximum=1, allowed="a number within [0, 1]")
        Traceback (most recent call last):
        ...
        ValueError: blend eta must be a number within [0, 1], got 1.5
    """
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and _within(value, minimum, maximum)
        and (not positive or value > 0)
        and (not finite or math.isfinite(value))
    )
    if ok:
        return value  # type: ignore[return-value]
    if allowed is None:
        allowed = ("a finite " if finite else "a ") + ("positive number" if positive else "number")
        if minimum is not None or maximum is not None:
            allowed += f" within [{'-inf' if minimum is None else minimum}, {'inf' if maximum is None else maximum}]"
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_finite(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
    allowed: str | None = None,
) -> float:
    """:func:`check_number` with ``finite=True``: infinities and NaN refused."""
    return check_number(name, value, minimum=minimum, maximum=maximum, positive=positive, finite=True, allowed=allowed)


def check_choice(option: str, value: object, allowed: tuple[str, ...]) -> str:
    """``value`` when it is one of ``allowed``; ``ValueError`` naming the allowed values otherwise.

    Example:
        >>> check_choice("qkv_order", "sglang", ("hf", "megatron"))
        Traceback (most recent call last):
        ...
        ValueError: qkv_order must be one of 'hf', 'megatron', got 'sglang'
    """
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{option} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
    return value
