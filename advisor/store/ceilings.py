"""The run store's measured ceilings: one checked JSON file per device under ``traces/ceilings/``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from advisor.errors import AdvisorError
from advisor.spec.ceilings import CEILINGS_DIR, Ceilings, load_ceilings
from advisor.spec.specs import HardwareSpec
from advisor.store.runstore import default_root, is_run_dir, write_json_atomic


def ceilings_path(device_name: str, root: str | Path | None = None) -> Path:
    """Where the ceilings of the device called ``device_name`` are stored in the run store at
    ``root`` (default: ``advisor.store.runstore.default_root()``)."""
    from advisor.spec.presets import device_slug

    return Path(root or default_root()) / CEILINGS_DIR / f"{device_slug(device_name)}.json"


def store_ceilings(c: Ceilings, root: str | Path | None = None) -> Path:
    """Save ``c`` as the stored ceilings of its device (replacing older ones atomically)."""
    path = ceilings_path(c.device_name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, c.to_dict())
    return path


def stored_ceilings(device_name: str, root: str | Path | None = None) -> Ceilings | None:
    """The stored ceilings of ``device_name``, None when none were measured; AdvisorError (naming the
    file and what is wrong) when the stored file is damaged or belongs to another device."""
    path = ceilings_path(device_name, root)
    if not path.is_file():
        return None
    c = load_ceilings(path)
    if c.device_name != device_name:
        raise AdvisorError(f"ceilings file {path.name} is for {c.device_name!r}, not {device_name!r}")
    return c


def ceilings_lookup(root: str | Path | None = None) -> Callable[[HardwareSpec], Ceilings | None]:
    """A lookup of the ceilings stored for a device in the run store at ``root`` (default: the
    default store), for ``advisor.analysis.roofline.trace_roofline``, which finds the device from the
    trace and stays out of the store itself."""
    return lambda hardware: stored_ceilings(hardware.name, root)


def run_ceilings(path: str | Path) -> Callable[[HardwareSpec], Ceilings | None] | None:
    """For one of our run directories, the lookup of ceilings in the store it sits in (our own runs
    are judged against the roofs measured on their device); None for any other trace (datasheet)."""
    p = Path(path)
    return ceilings_lookup(p.parent) if is_run_dir(p) else None
