"""Hand-rolled mutation testing (issue 51; docs/testing.md, "Mutation testing"): each mutant
one operator changed in one module of a COPY of the repository (comparisons flipped, + and -
swapped, * and / swapped, and/or swapped, a `not` dropped; the module rewritten by
ast.unparse), the given tests run with -x (a hang past 240 s counts as killed); a mutant is
killed when they fail. One line per mutant, then the totals. Never point ROOT at a checkout
others work in: the module is rewritten in place while its mutant runs.

usage:
  rm -rf /tmp/mc; mkdir /tmp/mc; git archive HEAD | tar -x -C /tmp/mc
  python scripts/mutate.py /tmp/mc runner/precision/fp4_quant.py tests/test_docs_promises.py tests/test_fp4.py
  python scripts/mutate.py /tmp/mc runner/answers/recipe_search.py:outcome,gap TESTS...   # those functions only
"""

import ast
import os
import subprocess
import sys
import time

FLIP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult}


def sites(tree, funcs):
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
            funcs and fn.name not in funcs
        ):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Compare):
                for i, op in enumerate(node.ops):
                    if type(op) in FLIP:
                        out.append((fn.name, node, ("cmp", i)))
            elif isinstance(node, ast.BinOp) and type(node.op) in BIN:
                out.append((fn.name, node, ("bin",)))
            elif isinstance(node, ast.BoolOp):
                out.append((fn.name, node, ("bool",)))
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                out.append((fn.name, node, ("not",)))
    # de-duplicate nodes seen from nested functions
    seen, uniq = set(), []
    for s in out:
        key = (id(s[1]), s[2])
        if key not in seen:
            seen.add(key)
            uniq.append(s)
    return uniq


def apply(node, kind):
    before = ast.unparse(node)
    if kind[0] == "cmp":
        node.ops[kind[1]] = FLIP[type(node.ops[kind[1]])]()
    elif kind[0] == "bin":
        node.op = BIN[type(node.op)]()
    elif kind[0] == "bool":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    return before


root, spec, tests = sys.argv[1], sys.argv[2], sys.argv[3:]
module, _, funcs = spec.partition(":")
funcs = set(filter(None, funcs.split(",")))
path = os.path.join(root, module)
source = open(path).read()
n = len(sites(ast.parse(source), funcs))
killed = survived = 0
for k in range(n):
    tree = ast.parse(source)
    fn, node, kind = sites(tree, funcs)[k]
    line = node.lineno
    if kind[0] == "not":
        before = ast.unparse(node)
        for parent in ast.walk(tree):  # replace `not x` by `x`
            for field, value in ast.iter_fields(parent):
                if value is node:
                    setattr(parent, field, node.operand)
                elif isinstance(value, list) and node in value:
                    value[value.index(node)] = node.operand
        after = ast.unparse(node.operand)
    else:
        before = apply(node, kind)
        after = ast.unparse(node)
    open(path, "w").write(ast.unparse(tree))
    t = time.time()
    try:
        rc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
            cwd=root,
            env={**os.environ, "PYTHONPATH": root},
            capture_output=True,
            timeout=240,
        ).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    open(path, "w").write(source)
    ok = rc != 0
    killed += ok
    survived += not ok
    print(
        f"{'KILLED  ' if ok else 'SURVIVED'} {module}:{line} {fn}: {before!r} -> {after!r} (rc {rc}, {time.time() - t:.0f}s)",
        flush=True,
    )
print(
    f"TOTAL {module} {funcs or ''}: {n} mutants, {killed} killed, {survived} survived", flush=True
)
