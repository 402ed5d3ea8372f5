"""Countdown: reach a target from 3–4 numbers with + − × ÷ (SPEC §2; one answer per episode).

Problems are generated with a guaranteed solution: draw the numbers, then combine random
pairs with random operations (subtraction kept positive, division only when exact) until one
value is left; that value is the target when it lies in ``[1, max_target]``, otherwise draw
again. ``env.solution`` holds the generating expression.

The answer is checked by parsing, never by executing: a character whitelist (digits, ``+ - * /``,
parentheses, ``.``, spaces), then ``ast.parse(mode="eval")`` and a walk
that accepts only number literals, the binary operators + − * / and unary ±
(parentheses are grouping only), evaluated exactly with ``fractions.Fraction``. ``×``, ``÷``
and ``−`` are read as ``*``, ``/`` and ``-``; a trailing ``= <result>`` is ignored. Anything
else (names, calls, powers, attributes, strings, over-long input) is rejected without being
run. Reward (SPEC §2): 1.0 when the expression uses exactly the given numbers (each once) and
equals the target; 0.1 when it uses exactly the given numbers but is wrong (division by zero
counts as wrong); 0.0 otherwise.

A rejected answer (empty, not an allowed expression) is an invalid action: no state change,
reward 0, and with the default ``max_steps=1`` the episode ends truncated. A well-formed
answer is graded and terminates the episode.

    from ragen_core.envs import make
    env = make("Countdown"); obs, _ = env.reset(seed=0); env.step(env.solution)
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from ragen_core.envs.base import StepOutcome, TextEnv, checked_params

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_DRAWS",
    "MAX_NUMBERS",
    "AnswerScore",
    "CountdownEnv",
    "CountdownProblem",
    "generate_problem",
    "parse_expression",
    "score_answer",
]

MAX_ANSWER_CHARS = 256
"""Longer answers are rejected before parsing (bounds parser work and recursion depth)."""
_MAX_NODES = 64
_MAX_LITERAL = 10**6
MAX_NUMBERS = 6
"""Most numbers in a problem: with more, products leave ``[1, max_target]`` so often that drawing a problem
stalls (50 numbers never finished; 6 take ~1 ms), and the reference plays 3-4."""
MAX_DRAWS = 100_000
"""Draws ``generate_problem`` makes before it gives up (parameters under which a target is that rare, such as
max_number 10**6 with max_target 1, would otherwise loop for ever)."""
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_RESULT_SUFFIX = re.compile(r"([^=]*)=\s*-?\d+(?:\.\d+)?", re.ASCII)
_ALLOWED_CHARS = re.compile(r"[0-9.+\-*/() \t\n]+", re.ASCII)
_TRANSLATE = str.maketrans({"×": "*", "÷": "/", "−": "-", "–": "-"})


@dataclass(frozen=True)
class CountdownProblem:
    numbers: tuple[int, ...]
    target: int
    solution: str
    """An expression that uses every number once and equals the target."""


@dataclass(frozen=True)
class AnswerScore:
    """How an answer was judged."""

    valid: bool
    """It parsed as an allowed arithmetic expression."""
    value: Fraction | None
    """Its exact value (None when invalid or on division by zero)."""
    uses_numbers: bool
    """Its literals are exactly the given numbers, each used once."""
    correct: bool
    reward: float
    reason: str = ""
    """Why it was rejected (empty when valid)."""


def generate_problem(rng: np.random.Generator, min_numbers: int = 3, max_numbers: int = 4,
                     max_number: int = 100, max_target: int = 100) -> CountdownProblem:
    """A problem with a known solution (module docstring); RuntimeError after ``MAX_DRAWS`` draws without one."""
    if not 2 <= min_numbers <= max_numbers or max_number < 1 or max_target < 1:
        raise ValueError("need 2 <= min_numbers <= max_numbers, max_number >= 1, max_target >= 1")
    for _ in range(MAX_DRAWS):
        n = int(rng.integers(min_numbers, max_numbers + 1))
        numbers = tuple(int(x) for x in rng.integers(1, max_number + 1, size=n))
        items: list[tuple[int, str]] = [(v, str(v)) for v in numbers]
        while len(items) > 1:
            i = int(rng.integers(len(items)))
            j = int(rng.integers(len(items) - 1))
            j += j >= i  # two distinct positions (cheaper than rng.choice without replacement)
            (a, ea), (b, eb) = items[i], items[j]
            op = int(rng.integers(4))
            if op == 1 and a == b:
                op = 0  # a - a = 0 would leave a useless zero
            if op == 3 and not (b > 1 and a % b == 0) and not (a > 1 and b % a == 0):
                op = 2  # no exact division available: multiply instead
            if op == 0:
                v, e = a + b, f"({ea} + {eb})"
            elif op == 1:
                (a, ea), (b, eb) = max((a, ea), (b, eb)), min((a, ea), (b, eb))
                v, e = a - b, f"({ea} - {eb})"
            elif op == 2:
                v, e = a * b, f"{_wrap(ea)} * {_wrap(eb)}"
            elif b > 1 and a % b == 0:
                v, e = a // b, f"{_wrap(ea)} / {_wrap(eb)}"
            else:
                v, e = b // a, f"{_wrap(eb)} / {_wrap(ea)}"
            items = [it for k, it in enumerate(items) if k not in (i, j)] + [(v, e)]
        value, expr = items[0]
        if 1 <= value <= max_target:
            if expr.startswith("(") and expr.endswith(")") and _balanced(expr[1:-1]):
                expr = expr[1:-1]
            return CountdownProblem(numbers=numbers, target=value, solution=expr)
    raise RuntimeError(f"no Countdown problem with {min_numbers}-{max_numbers} numbers up to {max_number} reaches a "
                       f"target in [1, {max_target}] in {MAX_DRAWS} draws; raise max_target or lower max_number")


def _wrap(e: str) -> str:
    wrapped = e.startswith("(") and e.endswith(")") and _balanced(e[1:-1])
    return e if e.isdigit() or wrapped else f"({e})"


def _balanced(e: str) -> bool:
    depth = 0
    for ch in e:
        depth += (ch == "(") - (ch == ")")
        if depth < 0:
            return False
    return depth == 0


def parse_expression(text: str) -> tuple[Fraction | None, list[Fraction]]:
    """Exact value and number literals of an arithmetic answer; raises ValueError if not allowed.

    Nothing is executed: the AST is walked and only Constant numbers, BinOp(+ - * /) and
    UnaryOp(+ -) are accepted. The value is None on division by zero.
    """
    if len(text) > MAX_ANSWER_CHARS:
        raise ValueError(f"answer longer than {MAX_ANSWER_CHARS} characters")
    text = text.translate(_TRANSLATE).strip()
    match = _RESULT_SUFFIX.fullmatch(text)
    if match:  # "3 + 5 - 4 = 4": grade the left side; the claimed result is ignored
        text = match.group(1).strip()
    if not text:
        raise ValueError("empty answer")
    if not _ALLOWED_CHARS.fullmatch(text):  # first gate: digits, operators, parentheses, spaces
        raise ValueError("characters other than digits, + - * / ( ) . and spaces")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as exc:
        raise ValueError(f"not an arithmetic expression ({type(exc).__name__})") from None
    literals = _checked_literals(tree.body)  # before _evaluate, which trusts the tree
    return _evaluate(tree.body), literals


def _checked_literals(body: ast.expr) -> list[Fraction]:
    """The number literals of a parsed answer; raises ValueError on any node outside the whitelist."""
    nodes = list(ast.walk(body))
    if len(nodes) > _MAX_NODES:
        raise ValueError("expression too large")
    literals: list[Fraction] = []
    for node in nodes:
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= _MAX_LITERAL:
                raise ValueError(f"literal not allowed: {str(v)[:20]!r}")
            literals.append(Fraction(v))
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _BINOPS:
                raise ValueError(f"operator not allowed: {type(node.op).__name__}")
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.UAdd, ast.USub)):
                # ValueError (not TypeError) throughout: this judges an answer, it is no API misuse.
                raise ValueError(f"operator not allowed: {type(node.op).__name__}")
        elif not isinstance(node, (ast.operator, ast.unaryop)):
            raise ValueError(f"syntax not allowed: {type(node).__name__}")
    return literals


def _evaluate(node: ast.expr) -> Fraction | None:
    """Exact value of an already-validated tree (None on division by zero)."""
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int | float)  # _checked_literals let only numbers through
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        v = _evaluate(node.operand)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    assert isinstance(node, ast.BinOp)
    a, b = _evaluate(node.left), _evaluate(node.right)
    if a is None or b is None:
        return None
    if isinstance(node.op, ast.Add):
        return a + b
    if isinstance(node.op, ast.Sub):
        return a - b
    if isinstance(node.op, ast.Mult):
        return a * b
    return None if b == 0 else a / b


def score_answer(text: str, numbers: tuple[int, ...], target: int) -> AnswerScore:
    """Judge an answer against a problem (module docstring for the reward rule)."""
    try:
        value, literals = parse_expression(text)
    except ValueError as exc:
        return AnswerScore(valid=False, value=None, uses_numbers=False, correct=False, reward=0.0,
                           reason=str(exc))
    uses = sorted(literals) == sorted(Fraction(n) for n in numbers)
    correct = uses and value is not None and value == target
    reward = 1.0 if correct else (0.1 if uses else 0.0)
    return AnswerScore(valid=True, value=value, uses_numbers=uses, correct=correct, reward=reward)


class CountdownEnv(TextEnv):
    """One arithmetic answer per episode (SPEC §2 table, row Countdown)."""

    name = "Countdown"
    free_form_actions = True
    budget_from_rollout = False  # one action by the rules of the game

    @checked_params
    def __init__(
        self,
        *,
        min_numbers: Annotated[int, Field(ge=2, le=MAX_NUMBERS)] = 3,
        max_numbers: Annotated[int, Field(ge=2, le=MAX_NUMBERS)] = 4,
        max_number: Annotated[int, Field(ge=1, le=_MAX_LITERAL)] = 100,  # answers with larger literals are refused
        max_target: Annotated[int, Field(ge=1, le=_MAX_LITERAL)] = 100,
        max_steps: Annotated[int, Field(ge=1)] | None = 1,
    ) -> None:
        super().__init__(max_steps=max_steps)
        if min_numbers > max_numbers:
            raise ValueError(f"min_numbers ({min_numbers}) exceeds max_numbers ({max_numbers})")
        self.min_numbers, self.max_numbers = min_numbers, max_numbers
        self.max_number, self.max_target = max_number, max_target
        self.reward_range = (0.0, 1.0)
        self._problem: CountdownProblem | None = None
        self._answer: str | None = None
        self._score: AnswerScore | None = None

    @property
    def numbers(self) -> tuple[int, ...]:
        return self._problem.numbers if self._problem else ()

    @property
    def target(self) -> int | None:
        return self._problem.target if self._problem else None

    @property
    def solution(self) -> str:
        """A correct answer to the current problem."""
        if self._problem is None:
            raise RuntimeError("call reset() first")
        return self._problem.solution

    def match_action(self, text: object) -> str | None:
        """Free-form: any non-empty string is an answer to judge."""
        if not isinstance(text, str) or not text.strip():
            return None
        return text.strip()

    def sample_action(self, rng: np.random.Generator) -> str:
        """A random expression over the given numbers (each once, random order and operators)."""
        nums = [str(self.numbers[int(i)]) for i in rng.permutation(len(self.numbers))]
        expr = nums[0]
        for n in nums[1:]:
            expr = f"({expr} {'+-*/'[int(rng.integers(4))]} {n})"
        return expr

    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        self._problem = generate_problem(rng, self.min_numbers, self.max_numbers, self.max_number,
                                         self.max_target)
        self._answer, self._score = None, None
        return {"numbers": list(self._problem.numbers), "target": self._problem.target}

    def _apply(self, action: str) -> StepOutcome:
        assert self._problem is not None
        score = score_answer(action, self._problem.numbers, self._problem.target)
        if not score.valid:
            return StepOutcome(invalid=True, info={"reason": score.reason})
        self._answer, self._score = action.translate(_TRANSLATE).strip(), score
        return StepOutcome(
            reward=score.reward, terminated=True, effective=True, success=score.correct,
            info={"value": None if score.value is None else float(score.value),
                  "uses_numbers": score.uses_numbers, "correct": score.correct},
        )

    def _action_names(self) -> tuple[str, ...]:
        return ("<arithmetic expression>",)

    def _state(self) -> Any:
        # The graded answer decides the rest of the observation (its value and verdict); None before it.
        p = self._problem
        return {"numbers": list(p.numbers) if p else [], "target": p.target if p else None, "answer": self._answer}

    def _instruction(self) -> str:
        return (
            "You are solving a Countdown puzzle. Write an arithmetic expression that uses each of the "
            "given numbers exactly once, with +, -, * and / and parentheses, and equals the target."
        )

    def render(self) -> str:
        if self._problem is None:
            return ""
        p = self._problem
        lines = [f"Numbers: [{', '.join(map(str, p.numbers))}]", f"Target: {p.target}"]
        if self._score is not None:
            s = self._score
            value = "undefined (division by zero)" if s.value is None else _fmt(s.value)
            verdict = "correct" if s.correct else "incorrect"
            lines.append(f"Your answer: {self._answer} -> {value} ({verdict})")
        return "\n".join(lines)


def _fmt(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{float(v):.6g}"
