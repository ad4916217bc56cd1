"""A tiny name -> builder map shared by models, norms, activations and data sets."""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from bnexp.support.errors import unknown_choice

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to builders; lookups of unknown names list the valid ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that stores ``obj`` under ``name``."""

        def add(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        """The builder registered under ``name``; ConfigError if there is none."""
        try:
            return self._items[name]
        except KeyError:
            raise unknown_choice(self.kind, name, self._items) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
