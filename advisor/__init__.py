"""The LLM training advisor: size, profile, analyze and advise (sub-packages in data-flow order)."""

from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
CHECKOUT: Path | None = _ROOT if (_ROOT / "pyproject.toml").is_file() else None
"""The repository this package runs from, or None for an installed package (site-packages)."""
