"""Coverage: does each entry class reach a fusion gate, and through which chain?

Asked by `loadplan coverage` with the entry classes an engine can build: an
entry class the registry does not know, or one that builds a family with
shared experts but reaches no gate, is exactly the silent-fallback bug class
this project removes (DESIGN 5.2, wrappers).
"""

from __future__ import annotations

from typing import Iterable

from loadplan.client.types import CoverageEntry
from loadplan.errors import FailedPrecondition, NotFound
from .rules import entries


def _entry(entry_class: str, known: bool, family: str, gated_family: bool, has_gate: bool,
           chain: tuple[str, ...], message: str) -> CoverageEntry:
    """The client's row type; ok: a known class whose family, if it needs a gate, has one."""
    return CoverageEntry(entry_class, known, family, gated_family, has_gate, chain, message,
                         ok=known and (not gated_family or has_gate))


def coverage_of(name: str) -> CoverageEntry:
    if name not in entries.ENTRY_CLASSES:
        known = ", ".join(sorted(entries.ENTRY_CLASSES))
        return _entry(name, False, "", False, False, (name,),
                      f"entry class {name!r} is not supported by the registry; supported: {known}")
    try:
        chain = entries.chain_of(name)
    except (NotFound, FailedPrecondition) as e:
        return _entry(name, True, "", True, False, (name,), f"delegation chain broken: {e}")
    built = entries.ENTRY_CLASSES[chain[-1]]
    family = entries.FAMILIES.get(getattr(built, "family", ""))
    if family is None:
        return _entry(name, True, "", True, False, chain, f"{chain[-1]} does not build a known family")
    gated = family.has_shared_experts or family.gated
    has_gate = family.gated
    via = " -> ".join(chain)
    if not gated:
        message = f"{via}: family {family.name} has no shared experts (no gate needed)"
    elif family.never_fuses is not None:
        message = f"{via}: family {family.name} never fuses ({family.never_fuses.rule})"
    elif has_gate:
        message = f"{via}: gated by the {family.name} fusion gate"
    else:
        message = f"{via}: family {family.name} has shared experts but no fusion gate"
    # Rules only: the registry plans it, loadplan's engine does not build it (an engine profile's entry).
    message += "; rules only (loadplan's engine does not build it)" if entries.rules_only(name) \
        else "; built by loadplan's engine"
    return _entry(name, True, family.name, gated, has_gate, chain, message)


def check_coverage(names: Iterable[str]) -> list[CoverageEntry]:
    """Empty `names` means the registry's own table."""
    names = list(names) or sorted(entries.ENTRY_CLASSES)
    return [coverage_of(n) for n in names]
