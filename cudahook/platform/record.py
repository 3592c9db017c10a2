"""Plain data classes for the hook path, without `dataclasses`.

`import dataclasses` pulls in `inspect` (with `ast`, `dis`, `tokenize`), and
each @dataclass compiles its methods when its module loads: together about
9 ms at every hook start, more than the rest of an action's own work. The
hooks start dozens of times per checkpoint, so their data classes derive
from Record instead, which gives what they used of @dataclass:

- fields are the class's annotated attributes, in order (a subclass's after
  its bases'); a class attribute is the field's default; a list, dict or set
  default is copied for each instance (dataclasses' default_factory);
- construction by position or keyword, `==` by fields, a repr, `as_dict()`;
- `frozen=True` in the class line: no assignment after construction, and
  hashable by fields.
"""

from __future__ import annotations

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_MISSING = object()
_COPIED = (list, dict, set)


class Record:
    _fields: tuple[str, ...] = ()
    _frozen = False

    def __init_subclass__(cls, frozen: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names = list(getattr(cls, "_fields", ()))
        # inspect.get_annotations would import inspect: what Record avoids.
        for name in cls.__dict__.get("__annotations__", {}):  # noqa: RUF063
            if name not in names:
                names.append(name)
        cls._fields = tuple(names)
        cls._frozen = frozen or cls._frozen
        if cls._frozen:
            cls.__hash__ = Record._hash  # type: ignore[method-assign]
        else:
            cls.__hash__ = None  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = self._fields
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}() takes {len(names)} arguments, "
                            f"{len(args)} given")
        values = dict(zip(names, args, strict=False))
        for name, value in kwargs.items():
            if name not in names:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword "
                                f"argument {name!r}")
            if name in values:
                raise TypeError(f"{type(self).__name__}() got multiple values for {name!r}")
            values[name] = value
        for name in names:
            if name not in values:
                default = getattr(type(self), name, _MISSING)
                if default is _MISSING:
                    raise TypeError(f"{type(self).__name__}() missing argument {name!r}")
                values[name] = type(default)(default) if isinstance(default, _COPIED) \
                    else default
            object.__setattr__(self, name, values[name])

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise AttributeError(f"cannot assign to field {name!r} of a frozen "
                                 f"{type(self).__name__}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._frozen:
            raise AttributeError(f"cannot delete field {name!r} of a frozen "
                                 f"{type(self).__name__}")
        object.__delattr__(self, name)

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, n) for n in self._fields)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def _hash(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._fields)
        return f"{type(self).__name__}({inner})"

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (shallow: nested values are the same objects)."""
        return {n: getattr(self, n) for n in self._fields}

    def replace(self, **changes: Any) -> Any:
        """A copy with `changes` (dataclasses.replace)."""
        return type(self)(**{**self.as_dict(), **changes})
