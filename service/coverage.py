"""Coverage: does each entry class reach a fusion gate, and through which chain?

Asked by `loadplan coverage` with the entry classes an engine can build: an
entry class the registry does not know, or one that builds a family with
shared experts but reaches no gate, is exactly the silent-fallback bug class
this project removes (DESIGN 5.2, wrappers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .errors import FailedPrecondition, NotFound
from .rules import entries


@dataclass(frozen=True)
class Coverage:
    entry_class: str
    known: bool
    family: str
    gated_family: bool
    has_gate: bool
    chain: tuple[str, ...]
    message: str

    @property
    def ok(self) -> bool:
        return self.known and (not self.gated_family or self.has_gate)


def coverage_of(name: str) -> Coverage:
    if name not in entries.ENTRY_CLASSES:
        known = ", ".join(sorted(entries.ENTRY_CLASSES))
        return Coverage(name, False, "", False, False, (name,),
                        f"entry class {name!r} is not supported by the registry; supported: {known}")
    try:
        chain = entries.chain_of(name)
    except (NotFound, FailedPrecondition) as e:
        return Coverage(name, True, "", True, False, (name,), f"delegation chain broken: {e}")
    built = entries.ENTRY_CLASSES[chain[-1]]
    family = entries.FAMILIES.get(getattr(built, "family", ""))
    if family is None:
        return Coverage(name, True, "", True, False, chain, f"{chain[-1]} does not build a known family")
    gated = family.has_shared_experts or family.gate is not None
    has_gate = family.gate is not None
    via = " -> ".join(chain)
    if not gated:
        message = f"{via}: family {family.name} has no shared experts (no gate needed)"
    elif has_gate:
        message = f"{via}: gated by the {family.name} fusion gate"
    else:
        message = f"{via}: family {family.name} has shared experts but no fusion gate"
    return Coverage(name, True, family.name, gated, has_gate, chain, message)


def check_coverage(names: Iterable[str]) -> list[Coverage]:
    """Empty `names` means the registry's own table."""
    names = list(names) or sorted(entries.ENTRY_CLASSES)
    return [coverage_of(n) for n in names]
