"""The one shape every registry of names has: attention families, feature maps, tasks, segmentation heads, block
types, dataset builders.

A registry maps a name (what a user writes: ``attn_family='performer'``, ``task: segmentation``) to what that name
builds. It reads like a dict (``name in REG``, ``REG[name]``, iteration in registration order) and adds three
verbs with one behaviour everywhere::

    HEADS = Registry('seg.head')
    HEADS.register('mlp', MLPHead)        # a second 'mlp' is a ValueError: nothing is silently replaced
    HEADS.get('mpl')                      # UnknownNameError: unknown seg.head 'mpl'; did you mean 'mlp'? ...
    HEADS.names()                         # ['mlp', 'fpn']
    HEADS.unregister('mlp')               # e.g. a name a test registered

This module is a leaf: it imports nothing from linvit, so every layer can hold a registry.
"""
import difflib
from typing import Dict, Generic, Iterable, Iterator, List, Optional, TypeVar

__all__ = ['Registry', 'UnknownNameError', 'suggestion']

T = TypeVar('T')


class UnknownNameError(KeyError, ValueError):
    """A name no registry entry has. A ValueError (a bad value in a config or argument) and a KeyError (a failed
    lookup), whose message reads as written (KeyError's own ``str`` would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ''


class Registry(Generic[T]):
    """name -> entry, in registration order.

    key: how users write a name of this registry (a config key or argument: ``'attn_family'``, ``'task'``), which
    every error message names.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._entries: Dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name``; returns ``entry``. ValueError if ``name`` holds another entry already
        (registering the same entry again, as a re-imported module does, changes nothing)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.key} name must be a non-empty string, got {name!r}")
        held = self._entries.get(name)
        if held is not None and held is not entry:
            raise ValueError(f"{self.key} {name!r} is already registered (by {_describe(held)}); unregister it "
                             f"first or choose another name")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        """The entry of ``name``; ``UnknownNameError`` naming the closest known names and all known ones."""
        if not isinstance(name, str) or name not in self._entries:
            raise UnknownNameError(self.unknown_message(name))
        return self._entries[name]

    def unknown_message(self, name: object, hint: str = '') -> str:
        """"unknown <key> <name>; did you mean ...? known: ..." (``hint``: one more sentence, e.g. another registry
        that holds the name)."""
        guess = suggestion(name, self._entries) if isinstance(name, str) else ''
        guess = f" {guess}" if guess else ''
        extra = f" ({hint})" if hint else ''
        return f"unknown {self.key} {name!r};{guess} known: {', '.join(self._entries) or 'none'}{extra}"

    def names(self) -> List[str]:
        """Every registered name, in registration order."""
        return list(self._entries)

    def unregister(self, name: str) -> T:
        """Remove ``name`` and return its entry; ``UnknownNameError`` if there is none."""
        entry = self.get(name)
        del self._entries[name]
        return entry

    def find(self, name: str) -> Optional[T]:
        """The entry of ``name``, or None (for callers that fall back rather than fail)."""
        return self._entries.get(name)

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> List[str]:
        return self.names()

    def items(self) -> List[tuple]:
        return list(self._entries.items())

    def values(self) -> List[T]:
        return list(self._entries.values())

    def __repr__(self) -> str:
        return f"Registry({self.key!r}: {', '.join(self._entries)})"


def suggestion(name: str, known: Iterable[str]) -> str:
    """"did you mean 'depth'?" naming the (up to three) known names closest to a misspelt ``name``; '' when none is
    close."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f"did you mean {_one_of([repr(c) for c in close])}?" if close else ''


def _one_of(words: List[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _describe(entry: object) -> str:
    return getattr(entry, '__qualname__', None) or getattr(entry, 'name', None) or type(entry).__name__
