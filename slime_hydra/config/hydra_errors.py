"""Errors Hydra and OmegaConf raise while composing, as Problems in slime_hydra's format (key, what, fix).

Hydra reports these itself with a traceback hint and exit code 1: an override it cannot parse (an unquoted ``;``,
a missing ``=``), an option a group does not have (``model=qwen3_9b``), a value of the wrong type
(``rollout.batch_prompts=abc``, ``train.lr=1e-3e``, ``cluster.colocate=maybe``), null for a field that is not
Optional. ``as_problems(error)`` reads the exception chain (OmegaConf's ValidationError carries the full key) and
gives one Problem naming the key and a fix; launch.py then exits 2 like every other config error.
"""

import re
from typing import Optional

from slime_hydra.options import Problem, nearest

_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "bool": "true or false"}


def _chain(error: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        out.append(error)
        error = error.__cause__ or error.__context__
    return out


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text and text.strip() else ""


def as_problems(error: BaseException, overrides: Optional[list[str]] = None) -> Optional[list[Problem]]:
    """Problems for a Hydra / OmegaConf composition error, or None when ``error`` is not one."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    chain = _chain(error)
    for e in chain:
        if isinstance(e, MissingConfigException) and e.options is not None and e.missing_cfg_file:
            group, _, option = e.missing_cfg_file.rpartition("/")
            options = [o for o in e.options if not o.startswith("base_")]
            hint = nearest(option, options)
            fix = f"did you mean {group}={hint}?" if hint else f"choose one of: {', '.join(options)}"
            return [Problem((group,), f"'{option}' is not an option of group {group} "
                                      f"(options: {', '.join(options)})", fix)]
        if isinstance(e, MissingConfigException):
            return [Problem((e.missing_cfg_file or "config",), _first_line(str(e)),
                            "check the option name (python launch.py --help lists every group's options)")]
        if isinstance(e, OverrideParseException):
            detail = next((_first_line(str(c)) for c in chain[1:] if _first_line(str(c))), _first_line(str(e)))
            bad = _bad_override(str(e), overrides)
            key = bad.split("=", 1)[0].lstrip("+~") if bad else "command line"
            if bad is not None and "=" not in bad:
                return [Problem((key,), f"the override {bad!r} has no value ({detail})", f"write {key}=<value>")]
            return [Problem((key,), f"cannot parse the override {bad!r}: {detail}" if bad
                            else f"cannot parse an override: {detail}",
                            f"quote the value for Hydra's override grammar, e.g. '{key}=\"...\"' (and for the shell)")]
    for e in chain:
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None) and getattr(e, "msg", None):
            key, message = e.full_key, _first_line(e.msg)
            return [Problem((key,), message, _fix_for(key, message))]
    if any(isinstance(e, ConfigCompositionException) for e in chain):
        return [Problem(("command line",), _first_line(str(chain[0])),
                        "check the override against python launch.py --cfg job")]
    return None


def _fix_for(key: str, message: str) -> str:
    wanted = re.search(r"could not be converted to (\w+)", message)
    if wanted:
        return f"set {key} to {_TYPE_WORDS.get(wanted.group(1), wanted.group(1))}"
    if "is not a valid bool" in message:
        return f"set {key}=true or {key}=false"
    if "is not Optional" in message:
        return f"give {key} a value (null is not allowed here)"
    if "is not a ListConfig" in message:
        return f"give {key} a list, e.g. {key}=[...]"
    if "not in" in message:
        return f"remove {key} (python launch.py --cfg job shows the keys)"
    return f"check the value of {key}"


def _bad_override(text: str, overrides: Optional[list[str]]) -> Optional[str]:
    """The override Hydra could not parse: named in its message, or the first one containing the offending text."""
    named = re.search(r"Error parsing override '([^']*)'", text) or re.search(r"Exception: (\S+)", text)
    if named:
        return named.group(1)
    for ov in overrides or []:
        if ";" in ov or "[" in ov and "]" not in ov or "=" not in ov:
            return ov
    return None
