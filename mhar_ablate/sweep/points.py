"""A study's grid points: which (arm, seed) a trial trains, read alike by the driver, its workers and the
export.

The arm is an Optuna categorical parameter (a study's arms are fixed by its definition). The seed is a
trial attribute, not a parameter: Optuna fixes a categorical's choices once a study has trials, and a
study must be able to grow by seeds (``--seeds`` larger than it ran with). Trials written before this
carry the seed as a parameter; both are read."""

from __future__ import annotations


def point_key(arm: str, seed: int) -> str:
    """The grid point's name, as trials record it (``grid_point``): ``ARM/sSEED``."""
    return f"{arm}/s{seed}"


def seed_of_key(point: str) -> int:
    """The seed a ``point_key`` names (arm names may hold ``/s``; the seed is after the last)."""
    return int(point.rsplit("/s", 1)[1])


def arm_seed(t) -> tuple[str, int] | None:
    """The (arm, seed) a trial trained, or None for one that never took a grid point (a surplus trial)."""
    arm = t.params.get("arm")
    seed = t.user_attrs.get("seed", t.params.get("seed"))
    if arm is None or seed is None:
        return None
    return arm, int(seed)


def trial_point(t) -> str | None:
    """The grid point a trial was queued for (or trained, in studies written before the queue)."""
    if "grid_point" in t.user_attrs:
        return t.user_attrs["grid_point"]
    point = arm_seed(t)
    return None if point is None else point_key(*point)
