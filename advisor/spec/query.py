"""The current setup as a page address's query parameters, and back: a link that reproduces a setup.

Only the fields that differ from DEFAULTS travel (``?model=llama-3.1-70b&tp=8``), so a link stays
short and a field left out means its default. Every DEFAULTS key round-trips; a config.json loaded
in place of a preset cannot travel (it is a file on the user's machine).
"""

from __future__ import annotations

from collections.abc import Mapping

from advisor.spec.defaults import DEFAULTS

TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def query_text(value: object) -> str:
    """A widget value as a query parameter's text: booleans as true/false, integral numbers without
    ".0" (a Gradio number arrives as 8.0), an empty number as "", the rest as str()."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def setup_query(values: Mapping[str, object]) -> dict[str, str]:
    """The query parameters of a setup's front-end values (DEFAULTS keys): those that differ from
    DEFAULTS, as text, in DEFAULTS' order (an emptied number as "": GPUs left empty means one
    replica). Keys outside DEFAULTS are left out."""
    return {
        k: query_text(values[k]) for k in DEFAULTS if k in values and query_text(values[k]) != query_text(DEFAULTS[k])
    }


def _parse(key: str, text: str) -> object:
    """``text`` as the type of DEFAULTS[key]; raises ValueError with what is allowed."""
    kind = type(DEFAULTS[key])
    if kind is bool:
        if text.lower() in TRUE + FALSE:
            return text.lower() in TRUE
        raise ValueError(f"must be true or false ({'/'.join(TRUE)} or {'/'.join(FALSE)})")
    if kind is int:
        if not text:
            return None
        try:
            return int(text)
        except ValueError:
            raise ValueError("must be a whole number") from None
    return text


def values_from_query(params: Mapping[str, str]) -> tuple[dict[str, object], list[str]]:
    """(values, problems) of a page address's query parameters: each known field's value in its
    DEFAULTS type, and one line per parameter left out because its name is unknown or its text does
    not parse (naming the parameter, its value and what is allowed). Whether a value is in range is
    the spec's to say, as for a value typed on the Size tab."""
    values: dict[str, object] = {}
    problems = []
    for key, text in params.items():
        if key not in DEFAULTS:
            problems.append(f"`{key}={text}`: unknown field (known: {', '.join(DEFAULTS)})")
            continue
        try:
            values[key] = _parse(key, text)
        except ValueError as err:
            problems.append(f"`{key}={text}`: {err}")
    return values, problems
