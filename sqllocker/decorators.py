"""What ``Locker.locked`` and ``AsyncLocker.locked`` share: how a call's lock is named, checked
against the decorated function's signature when it is decorated, and what to do when the lock
is busy.

``@locker.locked("report {day}")`` names its lock by putting the function's arguments, bound
by name (defaults included), into the template's fields, so ``report(day="2026-11-25")`` and
``report("2026-11-25")`` take the same lock. A name must identify its call: two calls that may
not run together must get one name, and two that may must not (one of them would be skipped).
So a field takes only a value whose text is an identity (``field_text``), and is refused at
call time otherwise; with two fields or more, the characters that could make one field's text
pass for the text between fields are percent-encoded in every field (``LockstringTemplate``).
``key=`` names the lock by a function of the caller's instead.
"""

from __future__ import annotations

import functools
import inspect
import logging
import string
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime, time, timezone
from decimal import Decimal
from enum import Enum
from typing import Any, TypeVar
from uuid import UUID

from .errors import LockBusy, LockTypeError, LockValueError
from .validation import check_hold_at_least, check_seconds, check_wait

R = TypeVar("R")

logger = logging.getLogger("sqllocker")

ON_BUSY = ("skip", "raise")

ACCEPTED = "str, int, bool, None, Decimal, date, datetime, time, UUID or an Enum of one of those"


def check_decoration(
    on_busy: object,
    wait: object,
    expires: object,
    hold_at_least: object,
    choices: Sequence[str] = ON_BUSY,
) -> str:
    """The options of ``locked()`` (or of a framework's decorator, whose ``on_busy`` has the
    ``choices`` given), checked when the function is decorated; returns ``on_busy``."""
    if on_busy not in choices:
        *others, last = (repr(choice) for choice in choices)
        raise LockValueError(f"on_busy must be {', '.join(others)} or {last}, not {on_busy!r}")
    check_wait(wait)
    if expires is not None:
        check_seconds(expires, "expires")
    check_hold_at_least(hold_at_least)
    return str(on_busy)


def lock_namer(
    lockstring: object, key: object, function: Callable[..., Any]
) -> Callable[[Sequence[Any], Mapping[str, Any]], str]:
    """How each call of ``function`` names its lock: by the ``lockstring`` template, or by
    ``key``, a callable given the call's own arguments that returns the lockstring."""
    if key is None:
        if lockstring is None:
            raise LockValueError(
                f"locked() on {function.__qualname__} needs a lockstring template or key="
            )
        return LockstringTemplate(lockstring, function).render
    if lockstring is not None:
        raise LockValueError(
            f"locked() on {function.__qualname__} takes a lockstring template or key=, not both"
        )
    if not callable(key):
        raise LockTypeError(f"key= must be a callable, not {type(key).__name__}")
    return KeyFunction(key, function).render


class KeyFunction:
    """``key=``: the caller's own function of the call's arguments, which returns the lockstring."""

    def __init__(self, key: Callable[..., Any], function: Callable[..., Any]) -> None:
        self.key = key
        self.function = function

    def render(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        name = self.key(*args, **kwargs)
        if not isinstance(name, str):
            raise LockTypeError(
                f"the key= of {self.function.__qualname__} returned {type(name).__name__}, "
                "not the lockstring (a str)"
            )
        return name


class LockstringTemplate:
    """A ``str.format`` template over a function's parameters, by name, whose fields are
    rendered so that distinct arguments give distinct lockstrings.

    Each field's text is ``field_text`` of its value. With two fields or more, ``%`` and the
    first character of the text between two fields are percent-encoded (as UTF-8 bytes, ``%``
    and two upper-case hex digits) in every field's text, and two fields must have text
    between them that does not begin with ``%``. Read from the left, each field then ends at
    the first of those characters not part of a ``%XX``, so a lockstring has one reading only.
    Nothing is encoded in a template of one field, whose text is the name's only variable part.
    """

    def __init__(self, template: object, function: Callable[..., Any]) -> None:
        if not isinstance(template, str):
            raise LockTypeError(
                f"a lockstring template must be a str, not {type(template).__name__}"
            )
        self.template = template
        self.function = function
        self.signature = call_signature(function)
        # Fields may name what a ``**kwargs`` of the function takes (Django's views take the
        # URL's values so): read from it when no parameter has the name.
        self.keywords = next(
            (
                name
                for name, parameter in self.signature.parameters.items()
                if parameter.kind is inspect.Parameter.VAR_KEYWORD
            ),
            None,
        )
        try:
            self.pieces = [
                (literal, field)
                for literal, field, spec, conversion in string.Formatter().parse(template)
                if _plain(template, field, spec, conversion)
            ]
        except ValueError as error:
            raise LockValueError(f"lockstring template {template!r}: {error}") from error
        fields = [field for _, field in self.pieces if field is not None]
        missing = sorted({_root(field) for field in fields} - set(self.signature.parameters))
        if missing and (self.keywords is None or not all(missing)):
            what = ", ".join(missing) if all(missing) else "a field by position ('{}')"
            raise LockValueError(
                f"lockstring template {template!r} names {what}, which "
                f"{function.__qualname__}{self.signature} does not take by name"
            )
        self.encoded = self._encoded_characters(len(fields))

    def _encoded_characters(self, field_count: int) -> frozenset[str]:
        """What is percent-encoded in each field's text (see the class)."""
        if field_count < 2:
            return frozenset()
        encoded = {"%"}
        # The literal before each field but the first separates it from the one before.
        separators = [literal for literal, field in self.pieces if field is not None][1:]
        for separator in separators:
            if not separator or separator.startswith("%"):
                between = "nothing" if not separator else "'%'"
                raise LockValueError(
                    f"lockstring template {self.template!r}: two fields with {between} "
                    "between them would give different calls one lock; put text between "
                    "them that does not begin with '%', such as '{a}-{b}', or name the lock "
                    "with key="
                )
            encoded.add(separator[0])
        return frozenset(encoded)

    def render(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The lockstring for one call's arguments; LockTypeError (nothing sent) if a field's
        value has no text that identifies it."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if self.keywords is not None:
            arguments = {**arguments[self.keywords], **arguments}
        formatter = string.Formatter()
        parts: list[str] = []
        for literal, field in self.pieces:
            parts.append(literal)
            if field is None:
                continue
            try:
                value, _ = formatter.get_field(field, (), arguments)
            except (AttributeError, LookupError, TypeError) as error:
                raise LockTypeError(
                    f"{self.function.__qualname__}: the field {{{field}}} of lockstring "
                    f"template {self.template!r} cannot be read ({type(error).__name__}: {error})"
                ) from error
            parts.append(self._encode(self._text(field, value)))
        return "".join(parts)

    def _text(self, field: str, value: object) -> str:
        try:
            return field_text(value)
        except LockTypeError as error:
            raise LockTypeError(
                f"{self.function.__qualname__}: the field {{{field}}} of lockstring template "
                f"{self.template!r} is {error}; pass {ACCEPTED}, name a field of it that is "
                "(such as {" + field + ".id}), or name the lock with key="
            ) from None
        except LockValueError as error:
            raise LockValueError(
                f"{self.function.__qualname__}: the field {{{field}}} of lockstring template "
                f"{self.template!r} is {error}"
            ) from None

    def _encode(self, text: str) -> str:
        if not self.encoded:
            return text
        return "".join(_percent(c) if c in self.encoded else c for c in text)


def call_signature(function: Callable[..., Any]) -> inspect.Signature:
    """The signature ``function`` is called with. That of a ``functools.partial``, or of a
    decorator's wrapper of one, is the partial's own, whatever its ``__wrapped__`` says:
    Django's ``method_decorator`` hands each decorator a partial of the bound method (or what
    the decorators before it made of it) made to look like the plain function, whose ``self``
    the calls do not pass."""
    inner = inspect.unwrap(function, stop=lambda wrapped: isinstance(wrapped, functools.partial))
    if isinstance(inner, functools.partial):
        return inspect.signature(functools.partial(inner.func, *inner.args, **inner.keywords))
    return inspect.signature(function)


def field_text(value: object) -> str:
    """The text of a lockstring field's value, one that identifies it: LockTypeError for a
    type whose text may not (an object's default ``str`` is its memory address, a float's
    ``-0.0`` and ``0.0`` are equal, two equal dicts can print differently), LockValueError for
    a Decimal NaN or infinity.

    An Enum member is its value's text; a ``str`` or ``int`` subclass (other than an Enum) its
    plain value's; an aware datetime is written in UTC, so that equal instants share a name; a
    Decimal without trailing zeros and exponent (``1.50`` and ``1.5`` are one value). An aware
    time is refused unless in UTC: without a date it cannot be brought to UTC by wrapping
    around midnight (Python compares ``00:30+01:00`` with ``23:30`` UTC as unequal)."""
    if isinstance(value, Enum):
        try:
            return field_text(value.value)
        except LockTypeError:
            member = f"{type(value).__module__}.{type(value).__qualname__}.{value.name}"
            raise LockTypeError(
                f"{member}, an Enum member whose value is a {type(value.value).__name__}, "
                "whose text may not identify it"
            ) from None
    if value is None:
        return "None"  # an optional argument left out
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, str):
        return str.__str__(value)
    kind = type(value)
    if kind is Decimal:
        return _decimal_text(value)  # type: ignore[arg-type]
    if kind is datetime:
        moment: datetime = value  # type: ignore[assignment]
        if moment.utcoffset() is not None:
            moment = moment.astimezone(timezone.utc)
        return moment.isoformat(sep=" ")
    if kind is time:
        clock: time = value  # type: ignore[assignment]
        if clock.utcoffset():  # equal to a time in another offset, written differently
            raise LockTypeError(
                f"a datetime.time at UTC offset {clock.utcoffset()}, whose text may not "
                "identify it (pass it in UTC)"
            )
        return str(clock)
    if kind is date or kind is UUID:
        return str(value)
    raise LockTypeError(f"a {kind.__module__}.{kind.__qualname__}, whose text may not identify it")


def _decimal_text(value: Decimal) -> str:
    if not value.is_finite():
        raise LockValueError(f"Decimal {value}, which names no lock")
    if not value:
        return "0"  # Decimal('-0.00') == 0
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)  # finite
    kept = len(digits)
    while digits[kept - 1] == 0:  # not all zero: the value is not 0
        kept -= 1
    exponent += len(digits) - kept
    return format(Decimal((sign, digits[:kept], exponent)), "f")


def _percent(character: str) -> str:
    return "".join(f"%{byte:02X}" for byte in character.encode("utf-8", "surrogatepass"))


def _plain(template: str, field: str | None, spec: str | None, conversion: str | None) -> bool:
    """Whether a parsed piece has no format spec or conversion, which could drop what tells two
    values apart (``{name:.3}``, ``{when:%Y}``); else LockValueError. Always True."""
    if field is not None and (spec or conversion):
        raise LockValueError(
            f"lockstring template {template!r}: a field takes no format spec or conversion "
            f"('{{{field}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}'), "
            "which could give different calls one lock; name the lock with key= instead"
        )
    return True


def _root(field: str) -> str:
    """``day`` of ``day``, ``job.name`` or ``days[0]``."""
    for separator in ".[":
        field = field.split(separator, 1)[0]
    return field


def finished(function: Callable[..., Any], result: R) -> R:
    """``result``, returned by ``function`` while its lock is held: LockTypeError instead if it
    is work still to be done (a coroutine, a generator, any awaitable), which would run after
    the release, beside the next holder. A coroutine or generator is closed unrun."""
    if not (
        inspect.isawaitable(result) or inspect.isgenerator(result) or inspect.isasyncgen(result)
    ):
        return result
    if inspect.iscoroutine(result) or inspect.isgenerator(result):
        result.close()  # never to run (an async generator not begun has nothing to close)
    elif callable(cancel := getattr(result, "cancel", None)):
        try:
            cancel()  # a task or future: cancelled, if it has not begun
        except Exception as error:  # a loop closed meanwhile, say: the refusal stands
            logger.warning("could not cancel what %s returned: %s", function.__qualname__, error)
    kind = type(result).__name__
    raise LockTypeError(
        f"{function.__qualname__} returned a {kind}: the work in it would run after the lock "
        "is released, beside the next holder; lock where the work runs (an async function: "
        "sqllocker.asyncio.AsyncLocker.locked, or `async with` a lock inside it)"
    )


def refuse_deferred_work(function: Callable[..., Any]) -> None:
    """LockTypeError if ``function`` is a generator function (sync or async): its body runs as
    its result is iterated, after the call has returned and the lock has been released."""
    if inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function):
        raise LockTypeError(
            f"{function.__qualname__} is a generator function: its body runs as it is "
            "iterated, after the lock is released; take the lock inside it instead "
            "(`with locker.lock(...)`, or `async with` for an async generator)"
        )


def when_busy(on_busy: str, function: Callable[..., Any], busy: LockBusy) -> None:
    """Skip the call (None, logged at INFO), or raise ``busy``."""
    if on_busy == "raise":
        raise busy
    logger.info("skipped %s: %s", function.__qualname__, busy)
