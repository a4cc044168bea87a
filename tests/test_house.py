"""The package's layout holds its rules (docs/architecture.md): one folder per role, imports
that run one way, small modules and functions, and comments that say why in a few lines
without the history of how a number was reached (that lives in docs/results.md)."""

import ast
import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "asyncfp8"
MAX_TOP_LEVEL_MODULES = 6  # __init__ included
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_COMMENT_LINES = 5
# A comment cites how a number was reached: a session, a study's seed, a named testbed.
HISTORY = re.compile(
    r"\bsession \d+|\bsessions \d+|\b(FP8|FP16|BF16|INT8)[^.\n]{0,20}\bseed \d+|"
    r"stability study|parity testbed|issue \d+",
    re.IGNORECASE,
)


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_the_top_level_keeps_a_few_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_module_or_function_is_too_long():
    long_modules = [
        f"{name(p)}: {n}" for p in modules() if (n := p.read_text().count("\n")) > MAX_MODULE_LINES
    ]
    long_functions = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name(path)}:{node.lineno} {node.name}: {lines}")
    assert not long_modules and not long_functions, long_modules + long_functions


def comments(path: Path) -> list[tuple[int, int, str]]:
    """(first line, lines, text) of every docstring and every block of # comment lines."""
    source = path.read_text()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                text = body[0].value.value
                if isinstance(text, str):
                    out.append((body[0].lineno, text.strip().count("\n") + 1, text))
    block: list[tuple[int, str]] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row = token.start[0]
            if block and block[-1][0] != row - 1:
                out.append((block[0][0], len(block), "\n".join(t for _, t in block)))
                block = []
            block.append((row, token.string))
    if block:
        out.append((block[0][0], len(block), "\n".join(t for _, t in block)))
    return out


def test_comments_say_why_in_a_few_lines_without_history():
    too_long, history = defaultdict(list), []
    for path in modules():
        for line, lines, text in comments(path):
            if lines > MAX_COMMENT_LINES:
                too_long[name(path).split("/")[1]].append(f"{name(path)}:{line} ({lines} lines)")
            if match := HISTORY.search(text):
                history.append(f"{name(path)}:{line}: {match.group(0)!r}")
    assert not history, history
    assert not too_long, dict(too_long)


def rooms_imported() -> dict[str, set[str]]:
    """{room: the rooms it imports}, a room being a subpackage or a top-level module;
    imports inside functions count."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in modules():
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        room = parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                pieces = target.split(".")
                if pieces[0] == "asyncfp8" and len(pieces) > 1 and pieces[1] != room:
                    graph[room].add(pieces[1])
    return graph


def test_rooms_import_one_way():
    """No two rooms reach each other: the imports between them form no circle."""
    graph = rooms_imported()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = sorted(room for room in list(graph) if room in reaches(room))
    assert not circles, {room: sorted(graph[room]) for room in circles}
    # the rules docs/architecture.md states
    assert "chaos" not in set().union(*graph.values()), "only tests and benches import chaos"
    assert not {"engines", "learner", "train", "worker"} & graph["precision"]
    assert not {"learner", "train", "worker", "launch"} & graph["engines"]
