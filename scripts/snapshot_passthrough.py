#!/usr/bin/env python
"""Regenerate the pinned snapshot of SGLang's server options that ``slime_hydra.rollout.engines.sglang`` (and through
it ``slime_hydra.config.passthrough``) checks ``rollout.sglang`` against.

``slime_hydra/snapshots/sglang_server_args.json`` -- every field of ``sglang.srt.server_args.ServerArgs`` (SGLang
0.5.23). Read from the SGLang wheel, never installed and never imported (it pins its own torch):

    python -m pip download sglang==0.5.23 --no-deps --only-binary :all: --python-version 3.11 \
        --implementation cp --platform manylinux_2_34_x86_64 -d /tmp/sgl     # done by this script

In 0.5.23 ``ServerArgs`` is built with ``msgspec.defstruct`` from the namespace Structs listed in
``_INPUT_NAMESPACES`` of ``sglang/srt/server_args.py``; each lives in ``sglang/srt/arg_groups/fields/*.py`` and
declares fields as ``name: A[T, "help"] = default`` or ``name: A[T, Arg(...)] = default``. The script parses those
class bodies with ``ast``. CLI flags follow ``add_cli_args_from_dataclass`` in ``sglang/srt/arg_groups/arg_utils.py``:
``Arg.cli_name`` or ``--`` + name with ``_`` -> ``-``, plus ``Arg.aliases``; no flag for ``Arg(no_cli=True)`` or a
plain annotation without ``A[...]`` metadata. The ``parser.add_argument`` calls of ``ServerArgs.add_cli_args``
(dynamic choices, deprecated spellings, --config) add flags to their field, or land in ``cli_only`` when their dest
is no field (``from_cli_args`` drops those). The field set is cross-checked against ``POSITIONAL_FIELD_ORDER``
(``arg_groups/field_order.py``). Only option names, types, defaults and choices are kept, as data.

(``train.megatron`` needs no snapshot: it is checked against the installed megatron-core's TransformerConfig, the
dataclass the backend passes it to.)

Usage (from the repository root)::

    python scripts/snapshot_passthrough.py                                   # downloads the wheel
    python scripts/snapshot_passthrough.py --sglang-wheel /tmp/sgl/sglang-0.5.23-*.whl
    python scripts/snapshot_passthrough.py --check                           # exit 1 if stale

Output is deterministic (sorted keys, no timestamps), so a regeneration diff shows only real changes.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

SGLANG_VERSION = "0.5.23"
GENERATED_BY = "scripts/snapshot_passthrough.py"
OUT_DIR = Path(__file__).resolve().parent.parent / "slime_hydra" / "snapshots"

_MISSING = object()


# ----------------------------------------------------------------------------------------------------------------
# Reading sources: a wheel (zip), a directory, or a git repository at a ref.
# ----------------------------------------------------------------------------------------------------------------

class Source:
    """Text of files by path relative to a package or repository root."""

    def __init__(self, read: Callable[[str], str | None], describe: str):
        self._read = read
        self.describe = describe
        self._trees: dict[str, ast.Module | None] = {}

    def text(self, path: str) -> str | None:
        return self._read(path)

    def tree(self, path: str) -> ast.Module | None:
        if path not in self._trees:
            text = self._read(path)
            self._trees[path] = None if text is None else ast.parse(text, filename=path)
        return self._trees[path]

    def module_path(self, dotted: str) -> str | None:
        """The file of module ``a.b.c``: ``a/b/c.py`` or ``a/b/c/__init__.py``."""
        base = dotted.replace(".", "/")
        for candidate in (base + ".py", base + "/__init__.py"):
            if self._read(candidate) is not None:
                return candidate
        return None


def zip_source(wheel: Path) -> Source:
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    return Source(lambda p: archive.read(p).decode() if p in names else None, wheel.name)


# ----------------------------------------------------------------------------------------------------------------
# AST helpers
# ----------------------------------------------------------------------------------------------------------------

def literal(node: ast.AST | None) -> Any:
    """The JSON-able value of a literal expression, or _MISSING."""
    if node is None:
        return _MISSING
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value = _fold(node)
        if value is _MISSING:
            return _MISSING
    if isinstance(value, (tuple, set, frozenset)):
        value = list(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return _MISSING
    return value


_FOLD_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
             ast.Pow: lambda a, b: a ** b, ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b}


def _fold(node: ast.AST) -> Any:
    """Arithmetic on number literals (``2 ** 32``, ``1024 * 1024``), else _MISSING."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _fold(node.operand)
        return _MISSING if value is _MISSING else -value
    if isinstance(node, ast.BinOp) and type(node.op) in _FOLD_OPS:
        left, right = _fold(node.left), _fold(node.right)
        if left is _MISSING or right is _MISSING or (isinstance(node.op, ast.Pow) and abs(right) > 64):
            return _MISSING
        return _FOLD_OPS[type(node.op)](left, right)
    return _MISSING


def call_name(node: ast.AST) -> str:
    """``f`` for ``f(...)``, ``b`` for ``a.b(...)``."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def keywords(call: ast.Call) -> dict[str, ast.AST]:
    return {k.arg: k.value for k in call.keywords if k.arg is not None}


def find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def imported_from(tree: ast.Module, module: str, name: str, scope: list[ast.stmt] | None = None,
                  is_package: bool = False) -> str | None:
    """The absolute module a name is imported from in ``module`` (``scope`` first, then module level)."""
    for body in ([scope] if scope else []) + [tree.body]:
        for node in body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        if node.level:
                            parts = module.split(".") if is_package else module.split(".")[:-1]
                            base = parts[: len(parts) - (node.level - 1)]
                            return ".".join(base + ([node.module] if node.module else []))
                        return node.module
    return None


def unparse(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def store_default(entry: dict, node: ast.AST | None, value: Any = _MISSING) -> None:
    """``default`` (JSON value or null) plus ``default_source`` when the default is no literal."""
    if value is _MISSING:
        value = literal(node)
    if value is _MISSING:
        entry["default"] = None
        entry["default_source"] = unparse(node)
    else:
        entry["default"] = value


# ----------------------------------------------------------------------------------------------------------------
# SGLang
# ----------------------------------------------------------------------------------------------------------------

SGL_SERVER_ARGS = "sglang/srt/server_args.py"
SGL_FIELD_ORDER = "sglang/srt/arg_groups/field_order.py"


def download_sglang_wheel(version: str, dest: Path) -> Path:
    # one fixed wheel (CPython 3.11, manylinux x86_64) so the recorded sha256 does not depend on this machine
    subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps",
                    "--only-binary", ":all:", "--python-version", "3.11", "--implementation", "cp",
                    "--platform", "manylinux_2_34_x86_64", "-d", str(dest)], check=True)
    wheels = sorted(dest.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"no sglang {version} wheel in {dest}")
    return wheels[0]


def _sgl_choices(src: Source, module: str, tree: ast.Module, node: ast.AST) -> tuple[Any, str | None]:
    """Choices from Arg(choices=...): a literal, or module-level constants (and ``+`` of them) resolved through
    imports. Returns (choices or None, the expression when it is not a plain literal)."""
    value = _resolve_constant(src, module, tree, node)
    if value is _MISSING or not isinstance(value, list):
        return None, unparse(node)
    return value, None if literal(node) is not _MISSING else unparse(node)


def _resolve_constant(src: Source, module: str, tree: ast.Module, node: ast.AST, depth: int = 0) -> Any:
    value = literal(node)
    if value is not _MISSING or depth > 5:
        return value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _resolve_constant(src, module, tree, node.left, depth + 1)
        right = _resolve_constant(src, module, tree, node.right, depth + 1)
        if isinstance(left, list) and isinstance(right, list):
            return left + right
        return _MISSING
    if isinstance(node, ast.List):
        items = [_resolve_constant(src, module, tree, e, depth + 1) for e in node.elts]
        return _MISSING if any(i is _MISSING for i in items) else items
    if isinstance(node, ast.Name):
        origin = imported_from(tree, module, node.id)
        path = src.module_path(origin) if origin else None
        origin_module, origin_tree = (origin, src.tree(path)) if path else (module, tree)
        for stmt in origin_tree.body:
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id
                                                    for t in stmt.targets):
                return _resolve_constant(src, origin_module, origin_tree, stmt.value, depth + 1)
    return _MISSING


def _sgl_field(src: Source, module: str, tree: ast.Module, stmt: ast.AnnAssign, ns: str) -> dict:
    name = stmt.target.id
    ann = stmt.annotation
    entry: dict[str, Any] = {"namespace": ns}
    meta: dict[str, ast.AST] | None = None
    inner = ann
    if isinstance(ann, ast.Subscript) and call_name(ann.value) in ("A", "Annotated"):
        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        inner = elts[0]
        for extra in elts[1:]:
            if isinstance(extra, ast.Constant) and isinstance(extra.value, str):
                meta = {}
                break
            if isinstance(extra, ast.Call) and call_name(extra) == "Arg":
                meta = keywords(extra)
                break
    entry["type"] = unparse(inner)

    # default: the assigned value; msgspec.field(default=... | default_factory=...)
    value = stmt.value
    if value is None:
        entry["default"] = None
        entry["required"] = True
    elif isinstance(value, ast.Call) and call_name(value) == "field":
        kw = keywords(value)
        if "default" in kw:
            store_default(entry, kw["default"])
        else:
            factory = kw.get("default_factory")
            empty = {"list": [], "dict": {}, "set": [], "tuple": []}
            if isinstance(factory, ast.Name) and factory.id in empty:
                entry["default"] = empty[factory.id]
            elif isinstance(factory, ast.Lambda):
                store_default(entry, factory.body)
            else:
                store_default(entry, factory)
    else:
        store_default(entry, value)

    # choices: Arg(choices=...) wins over Literal[...] (as add_cli_args_from_dataclass does)
    choices, choices_from = None, None
    if meta and "choices" in meta:
        choices, choices_from = _sgl_choices(src, module, tree, meta["choices"])
    if choices is None:
        lit = inner
        if isinstance(lit, ast.Subscript) and call_name(lit.value) == "Optional":
            lit = lit.slice
        if isinstance(lit, ast.Subscript) and call_name(lit.value) == "Literal":
            elts = lit.slice.elts if isinstance(lit.slice, ast.Tuple) else [lit.slice]
            choices = [literal(e) for e in elts]
            if choices_from:
                choices_from += " (not resolved; the choices are the annotation's Literal)"
    entry["choices"] = choices
    if choices_from:
        entry["choices_from"] = choices_from

    # flags
    if meta is None:
        entry["flags"] = []
        entry["cli"] = "none: no A[...] metadata, so add_cli_args_from_dataclass skips it"
    elif literal(meta.get("no_cli")) is True:
        entry["flags"] = []
        entry["cli"] = "none: Arg(no_cli=True)"
    else:
        cli_name = literal(meta.get("cli_name"))
        aliases = literal(meta.get("aliases"))
        flags = [cli_name if isinstance(cli_name, str) else "--" + name.replace("_", "-")]
        flags += aliases if isinstance(aliases, list) else []
        entry["flags"] = flags
        entry["cli"] = "auto"
    for key in ("action", "nargs", "type_parser"):
        if meta and key in meta:
            v = literal(meta[key])
            entry[key] = unparse(meta[key]) if v is _MISSING else v
    return entry


def _namespace_classes(src: Source, tree: ast.Module) -> list[tuple[str, str]]:
    """(class name, module) of each entry of ``_INPUT_NAMESPACES``, in order."""
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                for t in stmt.targets):
            names = [e.id for e in stmt.value.elts]
            return [(n, imported_from(tree, "sglang.srt.server_args", n)) for n in names]
    raise SystemExit(f"_INPUT_NAMESPACES not found in {SGL_SERVER_ARGS}: the ServerArgs layout changed")


def _is_classvar(ann: ast.AST) -> bool:
    target = ann.value if isinstance(ann, ast.Subscript) else ann
    return call_name(target) in ("ClassVar", "InitVar")


def sglang_snapshot(src: Source, version: str, wheel_sha256: str | None) -> dict:
    tree = src.tree(SGL_SERVER_ARGS)
    if tree is None:
        raise SystemExit(f"{SGL_SERVER_ARGS} not in {src.describe}")
    options: dict[str, dict] = {}

    def add(name: str, entry: dict, where: str) -> None:
        if name in options:
            raise SystemExit(f"field {name} declared twice ({options[name]['namespace']} and {where})")
        options[name] = entry

    namespaces = _namespace_classes(src, tree)
    for cls_name, module in namespaces:
        path = src.module_path(module)
        mtree = src.tree(path)
        cls = find_class(mtree, cls_name)
        if cls is None:
            raise SystemExit(f"class {cls_name} not found in {path}")
        if [unparse(b) for b in cls.bases] != ["msgspec.Struct"]:
            raise SystemExit(f"{cls_name} has bases {[unparse(b) for b in cls.bases]}: teach the script inheritance")
        ns = next((literal(s.value) for s in cls.body if isinstance(s, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "_NS_PATH" for t in s.targets)), cls_name)
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                    and not _is_classvar(stmt.annotation):
                add(stmt.target.id, _sgl_field(src, module, mtree, stmt, ns), cls_name)

    # annotations written on ServerArgs itself are merged in after the namespaces' ones
    server_args = find_class(tree, "ServerArgs")
    for stmt in server_args.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not _is_classvar(stmt.annotation):
            add(stmt.target.id, _sgl_field(src, "sglang.srt.server_args", tree, stmt, "ServerArgs"), "ServerArgs")

    # hand-registered flags of ServerArgs.add_cli_args
    cli_only: dict[str, dict] = {}
    add_cli = next(f for f in server_args.body if isinstance(f, ast.FunctionDef) and f.name == "add_cli_args")
    for call in ast.walk(add_cli):
        if not (isinstance(call, ast.Call) and call_name(call) == "add_argument"):
            continue
        flags = [literal(a) for a in call.args]
        kw = keywords(call)
        dest = literal(kw.get("dest")) if "dest" in kw else _derive_dest(flags)
        action = kw.get("action")
        deprecated = action is not None and "Deprecated" in unparse(action)
        choices = literal(kw.get("choices")) if "choices" in kw else None
        if dest in options:
            entry = options[dest]
            if not entry["flags"]:
                entry["cli"] = "manual: ServerArgs.add_cli_args"
            entry["flags"] = entry["flags"] + flags
            if deprecated:  # a legacy spelling: its own choices/const describe the flag, not the field
                entry["deprecated_flags"] = entry.get("deprecated_flags", []) + flags
                entry["cli"] += " (deprecated spelling " + unparse(action) + ")"
                continue
            if "choices" in kw and choices is _MISSING:
                entry["choices"] = None
                entry["choices_from"] = "dynamic: " + unparse(kw["choices"])
            elif choices not in (None, _MISSING):
                entry["choices"] = choices
        else:
            cli_only[dest] = {"flags": flags, "action": unparse(action), "deprecated": deprecated,
                              "note": "a CLI flag whose dest is no ServerArgs field (from_cli_args drops it)"}

    # cross-check against the positional order list, when the release has one
    order_tree = src.tree(SGL_FIELD_ORDER)
    if order_tree is not None:
        for stmt in order_tree.body:
            if isinstance(stmt, ast.Assign) and call_name(stmt.targets[0]) == "POSITIONAL_FIELD_ORDER":
                listed = set(literal(stmt.value))
                missing, extra = listed - set(options), set(options) - listed
                if missing:
                    raise SystemExit(f"fields in POSITIONAL_FIELD_ORDER the parse missed: {sorted(missing)}")
                if extra:
                    print(f"note: fields not in POSITIONAL_FIELD_ORDER (appended by SGLang): {sorted(extra)}")

    return {
        "source": "sglang.srt.server_args.ServerArgs",
        "version": version,
        "generated_by": GENERATED_BY,
        "source_detail": {
            "distribution": f"sglang=={version} wheel" + (f" (sha256 {wheel_sha256})" if wheel_sha256 else ""),
            "files": [SGL_SERVER_ARGS, "sglang/srt/arg_groups/arg_utils.py", SGL_FIELD_ORDER]
                     + sorted({src.module_path(m) for _, m in namespaces}),
            "namespaces": [n for n, _ in namespaces],
            "flag_rule": "Arg.cli_name or '--' + field name with '_' -> '-', plus Arg.aliases; no flag when "
                         "Arg(no_cli=True) or the annotation has no A[...] metadata; ServerArgs.add_cli_args "
                         "registers some by hand (cli: manual ...)",
        },
        "options": dict(sorted(options.items())),
        "cli_only": dict(sorted(cli_only.items())),
    }


def _derive_dest(flags: list[str]) -> str:
    """argparse's dest for optionals: the first long flag (else the first flag), dashes stripped, '-' -> '_'."""
    long = [f for f in flags if isinstance(f, str) and f.startswith("--")]
    first = long[0] if long else flags[0]
    return first.lstrip("-").replace("-", "_")


COMMON_KEYS = ("type", "default", "flags", "choices")


def dump(snapshot: dict) -> str:
    """JSON text; every option carries type, default, flags and choices first (null where argparse has none)."""
    for name, opt in snapshot["options"].items():
        snapshot["options"][name] = {**{k: opt.get(k) for k in COMMON_KEYS},
                                     **{k: v for k, v in opt.items() if k not in COMMON_KEYS}}
    return json.dumps(snapshot, indent=1, sort_keys=False, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang-version", default=SGLANG_VERSION)
    parser.add_argument("--sglang-wheel", help="an sglang wheel already downloaded (else pip download)")
    parser.add_argument("--out-dir", default=str(OUT_DIR))
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = parser.parse_args(argv)

    outputs: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(args.sglang_wheel) if args.sglang_wheel else download_sglang_wheel(args.sglang_version, Path(tmp))
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        outputs["sglang_server_args.json"] = dump(sglang_snapshot(zip_source(wheel), args.sglang_version, sha))

    stale = []
    for name, text in outputs.items():
        path = Path(args.out_dir) / name
        count = len(json.loads(text)["options"])
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
            print(f"{name}: {count} options, {'STALE' if name in stale else 'up to date'}")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path} ({count} options, {len(text.encode()) // 1024} KiB)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
