"""Math with a final answer: binary reward by equivalence of the extracted answer to the reference.

Extraction (first that applies): the last `\\boxed{...}` / `\\fbox{...}` (balanced braces), else the text
after the last "answer is" / "answer:", else the last number in the completion.
Normalization strips `$`, `\\(...\\)`, `\\left`/`\\right`, `\\text{...}` units, degrees, percent, thousands
separators, a leading `x =` and trailing periods; LaTeX (`\\frac`, `\\dfrac`, `\\sqrt`, `\\pi`, `\\cdot`, `^`)
becomes a sympy expression.
Comparison: equal normalized strings; else exact rational equality; else numeric equality (relative
1e-9) of the difference at fixed points for each free symbol. No `simplify`, so the time is bounded.

Safety: the text is untrusted and sympy's parser evaluates Python, so only a whitelist of characters
and names reaches it (no `_`, no attribute access), the input is length-capped, and a power whose
numeric exponent is not a literal of magnitude <= 1000 is refused (`9^9^9^9` would never finish).
sympy does the algebra (library); the extraction and normalization are ours (no library fits; the
LaTeX parsers of sympy need antlr4 or lark and accept far more than answers).
"""

from __future__ import annotations

import re
import tokenize
from fractions import Fraction

from rlfleet.tasks.base import Problem
from rlfleet.tasks.datasets import DatasetTask, dataset_name, load_rows

MAX_ANSWER_CHARS = 200
MAX_EXPONENT = 1000
_POINTS = (0.5377, 1.8339, -2.2588)  # evaluation points for expressions with free symbols
_FUNCS = {"sqrt", "sin", "cos", "tan", "log", "ln", "exp", "pi", "abs"}

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?", re.IGNORECASE)


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the balanced `{...}` starting at text[start] == '{', and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (nested braces kept), or `\\boxed 5`."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        j = m.end()
        if j < len(text) and text[j] == "{":
            got = _braced(text, j)
            if got is not None:
                best = got[0]
        else:
            word = re.match(r"[^\s$]+", text[j:])
            if word:
                best = word.group(0)
    return best


def extract_answer(completion: str) -> str | None:
    """The final answer written in a completion, or None."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    said = list(_ANSWER_IS.finditer(completion))
    if said:
        rest = completion[said[-1].end() :].strip().splitlines()
        if rest and rest[0].strip(" *"):
            return rest[0].strip(" *")
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _unwrap(s: str, command: str) -> str:
    """Replace `\\command{X}` by X (balanced braces)."""
    out, i = [], 0
    pattern = re.compile(r"\\" + command + r"\s*(?=\{)")
    while True:
        m = pattern.search(s, i)
        if not m:
            break
        got = _braced(s, m.end())
        if got is None:
            break
        out.append(s[i : m.start()])
        out.append(got[0])
        i = got[1]
    out.append(s[i:])
    return "".join(out)


def _frac_to_division(s: str) -> str:
    """`\\frac{a}{b}` (also `\\frac12`, `\\frac{a}b`) -> `((a)/(b))`, innermost fractions included."""
    for _ in range(20):
        m = re.search(r"\\frac\s*", s)
        if not m:
            return s
        parts, j = [], m.end()
        for _arg in range(2):
            while j < len(s) and s[j] == " ":
                j += 1
            if j < len(s) and s[j] == "{":
                got = _braced(s, j)
                if got is None:
                    return s
                parts.append(got[0])
                j = got[1]
            elif j < len(s):
                parts.append(s[j])
                j += 1
            else:
                return s
        s = s[: m.start()] + f"(({parts[0]})/({parts[1]}))" + s[j:]
    return s


def normalize(answer: str) -> str:
    """A canonical plain-text form of an answer (LaTeX wrappers, units and separators removed)."""
    s = answer.strip().rstrip(". ")
    s = s.strip("$ ").rstrip(". ")
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s).strip().strip("$ ")
    for cmd in ("boxed", "fbox", "mathrm", "mathbf", "textbf", "displaystyle"):
        s = _unwrap(s, cmd)
    s = re.sub(r"(?<=[\d}])\s*\\(?:text|mbox)\s*\{[^{}]*\}\s*$", "", s).strip()  # trailing unit: 5\text{ cm}
    s = _unwrap(s, "text")
    s = re.sub(r"\\(?:left|right|displaystyle|!|,|;|:|quad|qquad)", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("{,}", ",")  # LaTeX thousands separator: 1{,}000
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\%|%|\\\$", "", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
    s = re.sub(r"\s+", " ", s).strip().rstrip(".").strip()
    # A trailing unit word after a number: "12 cm", "5 dollars" (not "2 x" or "3 pi").
    s = re.sub(r"^(-?[\d.,/]+)\s+(?!pi\b)[a-zA-Z]{2,}(?:\^?\d)?$", r"\1", s)
    m = re.match(r"^[a-zA-Z]\s*=\s*(.+)$", s)  # "x = 5" -> "5"
    if m:
        s = m.group(1)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _to_sympy_text(s: str) -> str | None:
    """The whitelisted sympy-parser input for a normalized answer, or None if it is not math."""
    s = _frac_to_division(s)
    s = re.sub(r"\\sqrt\s*\{", r"sqrt{", s)
    s = re.sub(r"\\sqrt\s*(\d|[a-zA-Z])", r"sqrt(\1)", s)
    s = re.sub(r"\\(pi|sin|cos|tan|log|ln|exp)\b", r" \1 ", s)
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    if len(s) > MAX_ANSWER_CHARS or not re.fullmatch(r"[0-9a-zA-Z+\-*/().\s]*", s) or not s.strip():
        return None
    if re.search(r"\.\s*[a-zA-Z]", s):  # attribute access, never a number
        return None
    for word in re.findall(r"[a-zA-Z]+", s):
        if len(word) > 1 and word not in _FUNCS:
            return None
    return s


def _parse(s: str):
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

    text = _to_sympy_text(s)
    if text is None:
        return None
    local = {"pi": sympy.pi, "e": sympy.E, "ln": sympy.log, "abs": sympy.Abs}
    local.update({c: sympy.Symbol(c) for c in "abcdfghjklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in local})
    try:
        expr = parse_expr(
            text,
            local_dict=local,  # the names reaching here are whitelisted above
            transformations=standard_transformations + (implicit_multiplication_application,),
            evaluate=False,
        )
    except (
        SyntaxError,
        TypeError,
        ValueError,
        AttributeError,
        NameError,
        IndexError,
        ZeroDivisionError,
        tokenize.TokenError,
        sympy.SympifyError,
    ):  # IndexError, TokenError: the parser on unbalanced brackets
        return None
    if not isinstance(expr, sympy.Expr):
        return None
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow) and not node.exp.free_symbols:
            if not node.exp.is_Number or abs(node.exp) > MAX_EXPONENT:
                return None
    return expr


def _as_fraction(s: str) -> Fraction | None:
    if re.fullmatch(r"-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+", s):
        try:
            return Fraction(s)
        except ZeroDivisionError:
            return None
    return None


def _closes_at_end(s: str) -> bool:
    """The bracket opening s[0] is the one closing at s[-1] (`(1, 2)` yes, `(x-1)(x+1)` no)."""
    depth = 0
    for i, ch in enumerate(s):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0:
            return i == len(s) - 1
    return False


def _split_top_level(s: str) -> list[str]:
    """`(1, 2)` or `1, 2` -> ["1", "2"]; commas inside brackets stay."""
    inner = s[1:-1] if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _closes_at_end(s) else s
    parts: list[str] = []
    depth, cur = 0, list[str]()
    for ch in inner:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur).strip())
    return parts


def _scalar_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb
    ea, eb = _parse(a), _parse(b)
    if ea is None or eb is None:
        return a.lower().replace(" ", "") == b.lower().replace(" ", "")
    import sympy

    try:
        ea, eb = ea.doit(), eb.doit()
        if any(v.has(sympy.zoo, sympy.oo, -sympy.oo, sympy.nan) for v in (ea, eb)):
            return False  # 1/0 equals nothing
        if ea.is_Rational and eb.is_Rational:
            return bool(ea == eb)
        symbols = sorted(ea.free_symbols | eb.free_symbols, key=str)
        points = [dict(zip(symbols, _POINTS[i:] + _POINTS[:i])) for i in range(len(_POINTS))] if symbols else [{}]
        for point in points:
            da, db = complex(ea.evalf(30, subs=point)), complex(eb.evalf(30, subs=point))
            if abs(da - db) > 1e-9 * max(1.0, abs(da), abs(db)):
                return False
        return True
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError, sympy.SympifyError):
        return False  # AttributeError: e.g. `{}1`, an empty tuple times 1, has no numeric value


def answers_match(given: str, reference: str) -> bool:
    """True when a written answer equals the reference numerically or symbolically."""
    a, b = normalize(given), normalize(reference)
    if not a or not b:
        return False
    pa, pb = _split_top_level(a), _split_top_level(b)
    if len(pa) != len(pb):
        return False
    return all(_scalar_equal(x, y) for x, y in zip(pa, pb))


def math_reward(completion: str, reference: str) -> float:
    answer = extract_answer(completion)
    return 1.0 if answer is not None and answers_match(answer, reference) else 0.0


class MathTask(DatasetTask):
    """Rows with a problem and a final answer (field `answer_field`)."""

    def __init__(self, rows: list[dict], name: str, prompt_template: str, answer_field: str = "answer", **kw):
        self.answer_field = answer_field
        self.required_fields = (answer_field,)
        super().__init__(rows, name, prompt_template, **kw)

    def answer(self, row: dict) -> str:
        return str(row[self.answer_field])

    def reward(self, problem: Problem, completion: str) -> float:
        return math_reward(completion, problem.answer)


def from_spec(spec) -> MathTask:
    """A MathTask from config.MathTaskSpec (loads the dataset)."""
    return MathTask(
        load_rows(spec.dataset),
        dataset_name(spec.dataset),
        spec.prompt_template,
        spec.answer_field,
        solve_rate_min=spec.solve_rate_min,
        solve_rate_max=spec.solve_rate_max,
        solve_rate_field=spec.solve_rate_field,
    )
