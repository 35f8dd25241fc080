"""The ingest's pre-run check, registered in rlfleet/wire/components.py (`prerun`): on a local run
(`rlfleet run`) an ingest that admits by invite needs its codes in a file it can read (door.py
`local_admission_problems`); found before anything starts."""

from __future__ import annotations

from rlfleet.config import Bundle
from rlfleet.services.ingest.door import local_admission_problems


def prerun_problems(bundle: Bundle) -> list[str]:
    """The ingest's problems with `bundle`, as `spec.ingest.…: what is wrong and the fix` lines; [] when none."""
    return local_admission_problems(bundle.run.spec)
