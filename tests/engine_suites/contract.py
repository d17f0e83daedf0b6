"""Contract checks of a release: its source is parsed (never imported or run) and each function the shim replaces
is compared with the shim's signature, and each call the engine makes of it with what the shim accepts. They find
a signature that moved in a release, before any test of behaviour.

write_checks(out_dir, checks) writes out_dir/contract.json and out_dir/test_contract.py, whose tests are:
  test_signature[id]  {"kind": "signature", "file": engine source, "qualname": "f" or "Class.method",
                       "shim": "module:qualname", "allow": {param: reason}}: every parameter of the engine's
                       function is accepted by the shim at the same position (positional ones) or by name, and has
                       the same default where the engine's is a literal; the shim requires nothing more.
  test_call[id]       {"kind": "call", "file", "caller": qualname or null, "callee": name, "shim"}: the engine calls
                       `callee` (at least once, inside `caller`), and every such call binds to the shim's signature.
`allow` names the engine parameters the shim takes another way, with the reason (reported in the test's output).
An optional `renamed` {engine param: shim param} names a parameter the shim has under another name at the same
position and also accepts by the engine's name (a release that renamed it): the position is checked.
"""
import ast
import importlib
import inspect
import json
from pathlib import Path

_TEST = '''"""Written by tests/engine_suites/contract.py: the shim's signatures against this release's source."""
import json
from pathlib import Path

import pytest

from engine_suites import contract

CHECKS = json.loads((Path(__file__).parent / "contract.json").read_text())


@pytest.mark.parametrize("check", [c for c in CHECKS if c["kind"] == "signature"], ids=lambda c: c["id"])
def test_signature(check):
    contract.check_signature(check)


@pytest.mark.parametrize("check", [c for c in CHECKS if c["kind"] == "call"], ids=lambda c: c["id"])
def test_call(check):
    contract.check_call(check)
'''


def write_checks(out_dir: Path, checks: list) -> list:
    """Writes the checks' test module; returns its pytest argument."""
    (Path(out_dir) / "contract.json").write_text(json.dumps(checks, indent=1))
    (Path(out_dir) / "test_contract.py").write_text(_TEST)
    return ["test_contract.py"]


def _shim(spec: str):
    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _is_overload(fn) -> bool:
    return any(ast.unparse(d).split(".")[-1] == "overload" for d in fn.decorator_list)


def _find(tree, qualname: str):
    """The FunctionDef at qualname ("f" or "Class.method"; an @overload stub is skipped for the real definition)."""
    scope, found = tree.body, None
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        nodes = [n for n in scope if getattr(n, "name", None) == part and
                 isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef) if last else ast.ClassDef)]
        if last:
            nodes = [n for n in nodes if not _is_overload(n)] or nodes
        if not nodes:
            return None
        found = nodes[-1]
        scope = found.body
    return found


def _engine_params(fn):
    """[(name, kind, default source or None)] of an engine function, self / cls left out."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [(p.arg, "positional", d) for p, d in zip(positional, defaults)]
    if out and out[0][0] in ("self", "cls"):
        out = out[1:]
    if a.vararg:
        out.append((a.vararg.arg, "*args", None))
    out += [(p.arg, "keyword", d) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "**kwargs", None))
    return out


def _literal(node):
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return False, None


def check_signature(check: dict) -> None:
    tree = ast.parse(Path(check["file"]).read_text())
    fn = _find(tree, check["qualname"])
    assert fn is not None, f"{check['qualname']} is not defined in {check['file']}: moved or removed in this release"
    shim = _shim(check["shim"])
    ours = [p for p in inspect.signature(shim).parameters.values() if p.name not in ("self", "cls")]
    by_name = {p.name: p for p in ours}
    positional = [p for p in ours if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_positional = any(p.kind == p.VAR_POSITIONAL for p in ours)
    var_keyword = any(p.kind == p.VAR_KEYWORD for p in ours)
    allow, renamed, problems, engine_names = check.get("allow", {}), check.get("renamed", {}), [], set()
    engine = _engine_params(fn)
    for index, (name, kind, default) in enumerate(engine):
        engine_names.add(name)
        if name in renamed:
            engine_names.add(renamed[name])
            if kind == "positional" and (index >= len(positional) or positional[index].name != renamed[name]):
                problems.append(f"positional parameter {name!r} is #{index} in the engine, not {renamed[name]!r} "
                                "in the shim")
            continue
        if name in allow:
            print(f"{check['qualname']}: {name} allowed: {allow[name]}")
            continue
        if kind == "*args":
            if not var_positional:
                problems.append(f"the engine takes *{name}, the shim no extra positional arguments")
            continue
        if kind == "**kwargs":
            if not var_keyword:
                problems.append(f"the engine takes **{name}, the shim no extra keywords")
            continue
        mine = by_name.get(name)
        if mine is None or mine.kind == mine.POSITIONAL_ONLY:
            if not var_keyword:
                problems.append(f"parameter {name!r} ({kind}) is not accepted by the shim")
            continue
        if kind == "positional" and (index >= len(positional) or positional[index].name != name):
            problems.append(f"positional parameter {name!r} is #{index} in the engine, not in the shim")
        if default is not None:
            is_literal, value = _literal(default)
            if mine.default is inspect.Parameter.empty:
                problems.append(f"{name!r} has a default in the engine ({ast.unparse(default)}), none in the shim")
            elif is_literal and mine.default != value:
                problems.append(f"{name!r} defaults to {value!r} in the engine, {mine.default!r} in the shim")
    for p in ours:
        if p.name not in engine_names and p.default is inspect.Parameter.empty and \
                p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            problems.append(f"the shim requires {p.name!r}, which the engine's signature lacks")
    assert not problems, f"{check['qualname']} ({check['file']}) against {check['shim']}:\n  " + "\n  ".join(problems)


def check_call(check: dict) -> None:
    tree = ast.parse(Path(check["file"]).read_text())
    scope = tree if check.get("caller") is None else _find(tree, check["caller"])
    assert scope is not None, f"{check['caller']} is not defined in {check['file']}: moved or removed"
    calls = [n for n in ast.walk(scope) if isinstance(n, ast.Call) and
             (getattr(n.func, "id", None) or getattr(n.func, "attr", None)) == check["callee"]]
    where = f"{check['file']}:{check.get('caller') or 'module'}"
    assert calls, f"{where} no longer calls {check['callee']}: the engine's call site moved"
    signature = inspect.signature(_shim(check["shim"]))
    params = list(signature.parameters.values())
    if params and params[0].name == "self":  # a method, called on its instance
        signature = signature.replace(parameters=params[1:])
    for call in calls:
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue  # *args / **kwargs splats: not bindable statically
        try:
            signature.bind(*[None] * len(call.args), **{k.arg: None for k in call.keywords})
        except TypeError as error:
            raise AssertionError(f"{where} line {call.lineno}: {ast.unparse(call)[:200]}... does not bind to "
                                 f"{check['shim']}{signature}: {error}") from None
