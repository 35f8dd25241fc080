"""The trainer's pre-run check, registered in rlfleet/wire/components.py (`prerun`): what `rlfleet run` refuses
before anything starts because the trainer would fail on it later: a tracker in spec.tracking whose package
is not installed (tracking.py), and a spec.eval whose held-out problems do not load (rlfleet/tasks/held_out.py)."""

from __future__ import annotations

from rlfleet.config import Bundle
from rlfleet.services.trainer.tracking import missing_packages
from rlfleet.tasks.held_out import held_out_problems


def prerun_problems(bundle: Bundle) -> list[str]:
    """The trainer's problems with `bundle`, as `spec.…: what is wrong and the fix` lines; [] when none."""
    spec = bundle.run.spec
    return missing_packages(spec.tracking) + held_out_problems(spec)
