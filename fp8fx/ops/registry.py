"""Python objects that compiled graphs reach by number: a graph holds an int (an op argument or
an input tensor's value), not the object, so it stays cacheable and outlives nothing.

Objects are held weakly: whoever registered one keeps it alive, and a number whose object was
collected finds nothing."""

from __future__ import annotations

import itertools
import weakref


class Registry:
    def __init__(self, kind: str, method: str):
        self.kind, self.method = kind, method  # what the objects are, and the method each must have
        self._objects: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
        self._numbers = itertools.count(1)

    def register(self, obj) -> int:
        """Register `obj`; returns its number."""
        if not callable(getattr(obj, self.method, None)):
            raise TypeError(f"fp8fx {self.kind} {obj!r} has no {self.method}() method")
        number = next(self._numbers)
        self._objects[number] = obj
        return number

    def unregister(self, number: int) -> None:
        self._objects.pop(number, None)

    def lookup(self, number: int):
        """The object registered under `number`, or None (never registered, unregistered, or collected)."""
        return self._objects.get(number)
