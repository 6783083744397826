"""
Template limits: a chat template is a program from a file, so every render runs on a budget.

Jinja's sandbox already refuses what a template may not touch (`__globals__`, `__mro__`,
changing a list); it bounds nothing else. A template can loop 10^10 times
(`{% for i in range(100000) %}{% for j in range(100000) %}`), make a string of 1.5 GB
(`{{ 'x' * 1500000000 }}`), or double one forty times in a loop. BoundedSandbox is the
sandbox with a Budget for each render:

    with render_budget():                    # one per render, on the thread that renders
        text = template.render(...)          # raises RenderLimit past any bound

  - steps: every loop item, call, filter and join takes one step, and the
    clock is read at each, so no render runs past RENDER_STEPS steps or RENDER_SECONDS;
  - characters: every string or list the template makes is counted (a container's items
    count one each, and a string's characters) against RENDER_MADE_CHARS, and an operation
    that could make more than it was given (`'x' * n`, `replace`, `join`, `center(n)`, a
    format's width) is refused before it runs when its estimate is more than what is left;
  - nesting: a macro that calls itself without end meets Python's recursion limit, which
    the caller reports as it reports any error of the template.

Why checks inside the render and not a timeout around it: a render runs on a worker thread
(the server's event loop must not wait for it), and Python cannot stop a thread. A thread
left spinning past its timeout would hold its worker, its memory and the GIL for good.
These checks make the template stop itself: the step after a bound is passed raises, and
the worker is free again.
"""

import contextlib
import contextvars
import functools
import re
import time

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_STEPS = 200_000       # real templates take 2-3 a message (Llama 3's 2, Qwen 2.5's 2.5)
RENDER_SECONDS = 1.0         # they render 100 messages in ~5 ms; this is for slow steps
RENDER_MAX_CHARS = 1 << 21   # the rendered prompt (~500K tokens of English: more than any
                             # context here holds), and the largest number a call may be given
RENDER_MADE_CHARS = 16 * RENDER_MAX_CHARS  # made in all: copies, joins, macros' outputs
ITEM_CHARS = 8  # what an item of a list costs, in characters: its pointer's bytes
MAX_ITEMS = 1 << 17  # in a list made, or given to a filter that works item by item in Python
# (sort's key, map's function: ~5 us an item here), so that one filter takes at most ~1 s
ITEMWISE = frozenset({"batch", "dictsort", "groupby", "map", "max", "min", "reject", "rejectattr",
                      "select", "selectattr", "slice", "sort", "sum", "unique"})
ATOMS = frozenset({int, float, bool, type(None)})
MAX_BITS = 1 << 16  # an integer's: 2**65536 takes a millisecond, 9**9**9 an hour
# the builtin calls and filters that can return more than they are given: their result is
# estimated (their inputs' size times their largest number or string) before they run
GROWING = frozenset({"batch", "center", "expandtabs", "format", "format_map", "indent", "join",
                     "ljust", "replace", "rjust", "slice", "tojson", "wordwrap", "zfill"})
# a width in a format string: "%0100000d", "{:>100000}", "{:x^100000}"
FORMAT_WIDTH = re.compile(r"[%:]\D{0,3}(\d+)")


class RenderLimit(Exception):
    """A render that went past a bound (the message says which)."""


class Budget:
    def __init__(self):
        self.steps, self.chars = RENDER_STEPS, RENDER_MADE_CHARS
        self.deadline = time.monotonic() + RENDER_SECONDS

    def step(self):
        self.steps -= 1
        if self.steps < 0:
            raise RenderLimit(f"it takes more than {RENDER_STEPS:,} steps (loop items and calls)")
        if time.monotonic() > self.deadline:
            raise RenderLimit(f"it takes longer than {RENDER_SECONDS:g} s")

    def afford(self, chars):
        """Refuse an operation whose result could hold more characters than are left."""
        if chars > self.chars:
            raise RenderLimit(f"it makes more than {RENDER_MADE_CHARS:,} characters")

    def spend(self, value):
        """Count a value made (or written): its size leaves the budget."""
        if isinstance(value, str):  # Markup too (|safe)
            self.chars -= len(value)
        else:
            check_items(value)
            self.chars -= size(value, self.chars + 1)
        if self.chars < 0:
            raise RenderLimit(f"it makes more than {RENDER_MADE_CHARS:,} characters")
        return value


_current = contextvars.ContextVar("render budget")


@contextlib.contextmanager
def render_budget():
    token = _current.set(Budget())
    try:
        yield
    finally:
        _current.reset(token)


def budget():
    """The budget of the render on this thread (a fresh one for what Jinja evaluates at
    compile time: a filter of constants)."""
    return _current.get(None) or Budget()


def size(value, limit):
    """Characters in a value: a string's length; a list's, tuple's, set's or dict's items
    ITEM_CHARS each (a pointer's bytes), plus their own size. Counted only up to past
    limit, without recursion (a list nested 100,000 deep is one more item each)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        value = stack.pop()
        if isinstance(value, (str, bytes)):
            total += len(value)
        elif isinstance(value, (list, tuple, set, frozenset, dict)):
            total += ITEM_CHARS * len(value)
            if total <= limit:  # only what has a size of its own: the rest are counted
                items = value.items() if isinstance(value, dict) else value
                stack.extend(v for v in items if v.__class__ not in ATOMS)
    return total


def largest_factor(values):
    """The most an argument could multiply a result by: a number, or a string's length."""
    return max([abs(v) for v in values if isinstance(v, int)]
               + [len(v) for v in values if isinstance(v, str)] + [0])


def check_growth(spent, name, values):
    """Before a call that may grow: every number it is given at most RENDER_MAX_CHARS, and
    its estimated result within what is left of the budget (spent)."""
    numbers = [v for v in values if isinstance(v, int) and abs(v) > RENDER_MAX_CHARS]
    if numbers:
        raise RenderLimit(f"'{name}' was given {numbers[0]:,}, more than {RENDER_MAX_CHARS:,}")
    if name in GROWING:
        given = sum(size(v, spent.chars + 1) for v in values)
        spent.afford((1 + given) * (1 + largest_factor(values)))


def check_items(value, what="a list"):
    if isinstance(value, (list, tuple, dict, set, str)) and len(value) > MAX_ITEMS:
        raise RenderLimit(f"{what} of more than {MAX_ITEMS:,} items")


def check_format(fmt):
    """A format string ('%05d', '{:>8}') whose widths stay under RENDER_MAX_CHARS."""
    if isinstance(fmt, str):
        widths = [int(w) for w in FORMAT_WIDTH.findall(fmt)]
        if widths and max(widths) > RENDER_MAX_CHARS:
            raise RenderLimit(f"a format width of {max(widths):,}, more than {RENDER_MAX_CHARS:,}")


def bounded_filter(name, function):
    """A filter that takes a step, checks its arguments and counts what it makes. functools.wraps
    keeps Jinja's pass_context mark: a filter given the context gets it first."""
    passed = 1 if hasattr(function, "jinja_pass_arg") else 0

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        spent = budget()
        spent.step()
        if name == "join" and len(args) > passed and not hasattr(args[passed], "__len__"):
            # a generator (a map's, a select's): its items taken first, to be sized
            args = (*args[:passed], list(counted(args[passed])), *args[passed + 1:])
        values = [*args[passed:], *kwargs.values()]
        if name in ITEMWISE and values:
            check_items(values[0], f"'{name}' given a value")
        if name == "format" and values:
            check_format(values[0])
        check_growth(spent, name, values)
        return spent.spend(function(*args, **kwargs))
    return bounded


def counted(iterable):
    """The items of a loop, a step each."""
    spent = budget()
    for item in iterable:
        spent.step()
        yield item


def joined(pieces):
    """A template's joins (`a ~ b`, and the output of a macro, a set block or a filter
    block, which Jinja collects in a list): sized before they are joined."""
    spent = budget()
    spent.step()
    pieces = [p if isinstance(p, str) else str(spent.spend(p)) for p in pieces]
    spent.afford(sum(map(len, pieces)))
    return spent.spend("".join(pieces))


class BoundedFilters(dict):
    """An environment's filters, each bounded (bounded_filter), those added later too."""

    def __init__(self, filters):
        super().__init__()
        for name, function in filters.items():
            self[name] = function

    def __setitem__(self, name, function):
        super().__setitem__(name, bounded_filter(name, function))


class CountedLoops(CodeGenerator):
    """Jinja's code generator, with each loop's items counted (`for x in counted(...)`)
    and each `~` joined by joined(): Jinja compiles a plain loop and `~` to plain Python,
    where nothing else could see them."""

    def visit_For(self, node, frame):
        items = nodes.Call(nodes.EnvironmentAttribute("counted"), [node.iter], [], None, None,
                           lineno=node.lineno)
        super().visit_For(nodes.For(node.target, items, node.body, node.else_, node.test,
                                    node.recursive, lineno=node.lineno), frame)

    def visit_Concat(self, node, frame):
        self.write("environment.concat((")
        for piece in node.nodes:
            self.visit(piece, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, where every render spends its Budget (render_budget)."""
    code_generator_class = CountedLoops
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    concat = staticmethod(joined)  # what Jinja's compiled code joins buffers with
    counted = staticmethod(counted)

    def __init__(self, **options):
        super().__init__(finalize=self.written, **options)
        del self.globals["lipsum"]  # lorem ipsum, as many paragraphs as asked
        self.filters = BoundedFilters(self.filters)

    @staticmethod
    def written(value):
        """Each {{ value }} written: counted as it becomes text."""
        return budget().spend(value)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's names)
        spent = budget()
        spent.step()
        if isinstance(__obj, Macro):  # the template's own: its insides take their own steps
            return __self.spend_call(__context, __obj, args, kwargs)
        method = getattr(__obj, "__wrapped__", __obj)  # str.format, as the sandbox wraps it
        owner = getattr(method, "__self__", None)
        values = [owner, *args, *kwargs.values()] if isinstance(owner, (str, list, dict)) else \
            [*args, *kwargs.values()]
        name = getattr(__obj, "__name__", "a call")
        if name in ("format", "format_map"):
            check_format(owner)
        check_growth(spent, name, values)
        return __self.spend_call(__context, __obj, args, kwargs)

    def spend_call(self, context, function, args, kwargs):
        return budget().spend(super().call(context, function, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        """`+ * ** %`, whose results are counted (no step: an operator repeats only in a
        loop, whose items take theirs), the last three checked before they run."""
        spent = budget()
        if operator == "*":
            if isinstance(left, int) and not isinstance(right, int):
                left, right = right, left
            if isinstance(right, int) and not isinstance(left, int):  # a sequence, repeated
                if not isinstance(left, str) and len(left) * right > MAX_ITEMS:
                    raise RenderLimit(f"a list of more than {MAX_ITEMS:,} items")
                spent.afford(size(left, spent.chars + 1) * right)
            elif isinstance(left, int):
                check_bits(left.bit_length() + right.bit_length())
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            check_bits(max(left.bit_length() - 1, 0) * right)
        elif operator == "%" and isinstance(left, str):
            check_format(left)
            check_growth(spent, "%", [*right] if isinstance(right, tuple) else [right])
        return spent.spend(self.binop_table[operator](left, right))


def check_bits(bits):
    if bits > MAX_BITS:
        raise RenderLimit(f"it makes a number of more than {MAX_BITS:,} bits")
