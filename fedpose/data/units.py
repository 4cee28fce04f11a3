"""Protection units: what one neighbouring dataset adds or removes (torch-free).

A site's DP guarantee is about one *unit* of its data (DESIGN.md, "Privacy semantics"):

* ``record``  — one person-crop (one annotation row). The finest unit: a guarantee per record
  says little about an image showing several people, or a patient with many images.
* ``image``   — every record of one image file (MPII: up to 4 people per image).
* ``patient`` — every record of one patient, over all their images (needs ``patient_id`` on
  every record; ids that differ only in letter case or spacing are one patient: :func:`patient_key`).
  Patients who appear together in one image are one unit: removing that image must touch one unit,
  and a patient's face in another patient's crop is theirs to protect too.

Sampling is Poisson over units and a unit's gradient (the sum over all its records) is clipped to
C as one (:mod:`fedpose.privacy.engine`), so (ε, δ) holds per unit without group privacy.

The default (``privacy.unit = "auto"``) is the coarsest unit the annotations support: patient
when every record has a ``patient_id``, else image when every record names its image, else
record. It is decided once, when the data is loaded (:func:`resolve_unit`), and stated in every
report; a federation site pins it in its budget state, where changing it is a guarantee change.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from fedpose.data.annotations import AnnotationError, PoseRecord

ProtectionUnit = Literal["record", "image", "patient"]
#: the config value that asks for the coarsest unit the annotations support
AUTO_UNIT = "auto"
#: finest first: a coarser unit's guarantee implies the finer ones' (a patient unit holds every image
#: its patients appear in: patients sharing an image are merged, UnitIndex.from_records)
UNITS_FINEST_FIRST: tuple[ProtectionUnit, ...] = get_args(ProtectionUnit)
#: what one unit is, in words a clinician reads
UNIT_MEANING: dict[str, str] = {
    "record": "one record (one person-crop: one annotated person in one image, with its keypoints)",
    "image": "one image (every annotated person in it, with their keypoints)",
    "patient": "one patient (every annotated crop of them, over all their images at this site; patients shown "
               "together in one image are protected as one unit)",
}


class UnitError(AnnotationError):
    """The requested protection unit is not supported by the annotations (names where)."""


@dataclass(frozen=True)
class UnitResolution:
    """Which unit a site's data is protected at, and why (stated in the run's log and reports)."""

    unit: ProtectionUnit
    requested: str  #: "auto" or the configured unit
    reason: str


def _missing(records: Sequence[PoseRecord], unit: ProtectionUnit) -> list[int]:
    """Indices of records that lack what ``unit`` needs."""
    if unit == "patient":
        return [i for i, r in enumerate(records) if not r.patient_id]
    if unit == "image":
        return [i for i, r in enumerate(records) if not r.image]
    return []


def supported_units(records: Sequence[PoseRecord]) -> tuple[ProtectionUnit, ...]:
    """Units every record supports, finest first ("record" always)."""
    return tuple(u for u in UNITS_FINEST_FIRST if not _missing(records, u))


def resolve_unit(requested: str, records: Sequence[PoseRecord], where: str) -> UnitResolution:
    """The protection unit for these records: ``requested``, or the coarsest supported for "auto".

    Raises :class:`UnitError` naming ``where`` and the first offending record when the requested
    unit needs a field some records lack (e.g. "patient" without ``patient_id``).
    """
    if requested == AUTO_UNIT:
        unit = supported_units(records)[-1]
        why = {"patient": "every record has a patient_id",
               "image": "not every record has a patient_id, but every record names its image",
               "record": "records name neither a patient nor an image"}[unit]
        return UnitResolution(unit, AUTO_UNIT, f"chosen automatically: the coarsest unit the annotations support ({why})")
    if requested not in UNITS_FINEST_FIRST:
        raise UnitError(f"{where}: unknown protection unit {requested!r}; choose one of {', '.join(UNITS_FINEST_FIRST)} or auto")
    missing = _missing(records, requested)  # type: ignore[arg-type]
    if missing:
        field = "patient_id" if requested == "patient" else "image"
        first = records[missing[0]]
        raise UnitError(
            f"{where}: privacy.unit = {requested!r} needs '{field}' on every record, but {len(missing)} of "
            f"{len(records)} records lack it (first: record {missing[0]}, image {first.image!r}). Annotate them, "
            f"or choose a finer unit (supported here: {', '.join(supported_units(records))})"
        )
    return UnitResolution(requested, requested, "as configured (privacy.unit)")  # type: ignore[arg-type]


@dataclass(frozen=True)
class UnitIndex:
    """The records of each unit: ``members[u]`` = record indices of unit u, ascending.

    Units are ordered by their first record, so the grouping is a function of the annotations
    only (no randomness, nothing released)."""

    unit: ProtectionUnit
    members: tuple[tuple[int, ...], ...]

    @property
    def num_units(self) -> int:
        return len(self.members)

    @property
    def num_records(self) -> int:
        return sum(len(m) for m in self.members)

    @property
    def max_records_per_unit(self) -> int:
        return max((len(m) for m in self.members), default=0)

    @classmethod
    def per_record(cls, num_records: int) -> "UnitIndex":
        """Every record its own unit (the record-level guarantee)."""
        return cls("record", tuple((i,) for i in range(int(num_records))))

    @classmethod
    def from_records(cls, records: Sequence[PoseRecord], unit: ProtectionUnit, where: str = "dataset") -> "UnitIndex":
        if unit == "record":
            return cls.per_record(len(records))
        resolve_unit(unit, records, where)  # raises, naming where, when a record lacks the key
        keys = [patient_key(str(record.patient_id)) if unit == "patient" else record.image for record in records]
        if unit == "patient":
            keys = _patients_sharing_an_image(records, keys)
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        return cls(unit, tuple(tuple(g) for g in groups.values()))


#: characters a registry or a spreadsheet writes for "-": hyphen-minus, hyphen, non-breaking hyphen,
#: figure dash, en and em dash, minus sign, small and full-width hyphen-minus
_DASHES = dict.fromkeys(map(ord, "\u2010\u2011\u2012\u2013\u2014\u2212\ufe63\uff0d"), "-")


def patient_key(patient_id: str) -> str:
    """The unit a patient id names. Ids that differ only in how they are written are one patient:
    letter case, spacing, Unicode compatibility forms (full-width "Ｐ"), invisible format characters
    (a zero-width space, a byte-order mark, a soft hyphen), dash variants, and the leading zeros of
    an all-digit id ("017" and 17: a spreadsheet drops them) — registries and hand-typed annotations
    mix them, and one patient split into two units would be protected only as each part (merging
    two real patients can only protect both more)."""
    text = unicodedata.normalize("NFKC", patient_id)
    text = "".join(c for c in text if unicodedata.category(c) != "Cf").translate(_DASHES)
    text = " ".join(text.split()).casefold()
    return str(int(text)) if text.isascii() and text.isdigit() else text


def _patients_sharing_an_image(records: Sequence[PoseRecord], patients: list[str]) -> list[str]:
    """Each record's unit key when patients shown in one image are one unit: the connected
    components of the patient–image graph (union-find), each named by its first patient. Without
    it, removing an image of two patients would move two units' gradients (2C), and a patient's face
    in the other's crop would be covered by neither's guarantee."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for record, patient in zip(records, patients):
        a, b = root("patient:" + patient), root("image:" + record.image)
        if a != b:
            parent[b] = a
    first: dict[str, str] = {}
    return [first.setdefault(root("patient:" + patient), patient) for patient in patients]
