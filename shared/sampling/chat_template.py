"""Renders Hugging Face chat templates the way transformers does, byte for byte.

The environment mirrors transformers' `_compile_jinja_template` (an immutable sandbox,
`trim_blocks`/`lstrip_blocks`, `loopcontrols`, a non-ASCII `tojson`, `raise_exception`,
`strftime_now`). Requests may bring templates, so rendering is bounded (`TemplateLimits`): steps,
deadline and built sizes, refused before allocation; past them, `TemplateLimitError`."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, wraps
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace


class ChatTemplateError(ValueError):
    """A template is missing, malformed, or rejected the conversation (`raise_exception`)."""


class TemplateLimitError(ChatTemplateError):
    """A template went past one of its `TemplateLimits` (too many steps, too long, too big)."""


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may do; real chat templates stay far inside these."""

    max_steps: int = 100_000  # loop iterations and calls, together
    # The longest string or list a template may build, the rendered text included.
    max_output_chars: int = 16 * 1024 * 1024
    timeout_s: float = 0.5


# Names the bounded environment gives each render; a template may not assign or define them.
_RESERVED_PREFIX = "_nori_"
_BUDGET_NAME = "_nori_budget"
_STEPS_NAME = "_nori_steps"
_JOIN_NAME = "_nori_join"
# A width or precision this long in a format string pads to gigabytes ("%0999999999d").
_HUGE_FORMAT_WIDTH = re.compile(r"\d{7,}")
# Big integers cost quadratic time to multiply and print; no template needs one this large.
_MAX_INT_BITS = 64 * 1024
_CLOCK_EVERY_STEPS = 256


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML and sorts keys; transformers uses plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Budget:
    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.steps_left = limits.max_steps
        self.deadline = time.monotonic() + limits.timeout_s

    def charge(self, steps: int = 1) -> None:
        before = self.steps_left
        self.steps_left -= steps
        if self.steps_left < 0:
            raise TemplateLimitError(
                f"chat template took more than {self.limits.max_steps} steps (loop iterations "
                "and calls)"
            )
        if before // _CLOCK_EVERY_STEPS != self.steps_left // _CLOCK_EVERY_STEPS:
            self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"chat template took more than {self.limits.timeout_s:g} s to render"
            )

    def counted(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.charge()
            yield item

    def range(self, *args: int) -> range:
        numbers = range(*args)
        if len(numbers) > self.limits.max_steps:
            raise TemplateLimitError(
                f"chat template asked for range{args}, more than {self.limits.max_steps} numbers"
            )
        return numbers

    def join(self, parts: Iterable[Any]) -> str:
        return _bounded_join(parts, self.limits.max_output_chars, self)


def _bounded_join(parts: Iterable[Any], max_chars: int, budget: _Budget | None = None) -> str:
    pieces = []
    size = 0
    for part in parts:
        text = str(part)
        size += len(text)
        if size > max_chars:
            raise TemplateLimitError(f"chat template output is longer than {max_chars} characters")
        pieces.append(text)
        if budget is not None and len(pieces) % _CLOCK_EVERY_STEPS == 0:
            budget.check_time()
    return "".join(pieces)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict) else 0


class _BoundedNamespace(Namespace):
    """`namespace()` with capped attributes: the one way a template keeps (and could double) a
    value across loop iterations."""

    max_chars = TemplateLimits.max_output_chars

    def __setitem__(self, name: str, value: Any) -> None:
        max_chars = self.__class__.max_chars  # (Namespace hides its attributes)
        if _size(value) > max_chars:
            raise TemplateLimitError(
                f"chat template stored a value of {_size(value)} items in namespace.{name}, more "
                f"than {max_chars}"
            )
        super().__setitem__(name, value)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: TemplateLimits) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self.limits = limits
        self.filters = {name: self._bounded_filter(f) for name, f in self.filters.items()}
        self.filters["tojson"] = self._bounded_filter(_tojson)
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["namespace"] = type(
            "namespace", (_BoundedNamespace,), {"max_chars": limits.max_output_chars}
        )

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        return not isinstance(obj, _Budget) and super().is_safe_attribute(obj, attr, value)

    def concat(self, parts: Iterable[Any]) -> str:
        return _bounded_join(parts, self.limits.max_output_chars)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """The syntax tree, with every loop's iterable counted and every `~` capped."""
        tree = super()._parse(source, name, filename)
        defined = [
            *((n.name, n.lineno) for n in tree.find_all(nodes.Name) if n.ctx != "load"),
            *((m.name, m.lineno) for m in tree.find_all(nodes.Macro)),
        ]
        for defined_name, lineno in defined:
            if defined_name.startswith(_RESERVED_PREFIX):
                raise jinja2.TemplateSyntaxError(
                    f"names starting with {_RESERVED_PREFIX} are reserved", lineno
                )
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(
                nodes.Name(_STEPS_NAME, "load"), [loop.iter], [], None, None, lineno=loop.lineno
            )
        for concat in tree.find_all(nodes.Concat):
            parts = nodes.List(concat.nodes, lineno=concat.lineno)
            concat.nodes = [nodes.Call(nodes.Name(_JOIN_NAME, "load"), [parts], [], None, None)]
        return tree

    def _refuse_big(self, what: str, size: int) -> None:
        if size > self.limits.max_output_chars:
            raise TemplateLimitError(
                f"chat template {what} would make {size} items, more than "
                f"{self.limits.max_output_chars}"
            )

    def _check_arguments(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Refuses a call whose result would be huge: widths and counts over the cap, padding
        format strings, and `replace` or `join` results past the cap."""
        name = getattr(func, "__name__", "a call").removeprefix("sync_").removeprefix("do_")
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > self.limits.max_output_chars:
                raise TemplateLimitError(
                    f"chat template passed {value} to {name}, more than the limit of "
                    f"{self.limits.max_output_chars}"
                )
        receiver = getattr(func, "__self__", None)
        if isinstance(receiver, str):
            args = (receiver, *args)
        elif args and isinstance(args[0], jinja2.nodes.EvalContext):
            args = args[1:]  # a filter's evaluation context, before its value
        formats = (
            [a for a in args[:1] if isinstance(a, str)] if name in ("format", "format_map") else []
        )
        if any(_HUGE_FORMAT_WIDTH.search(text) for text in formats):
            raise TemplateLimitError("chat template format string has a huge width")
        if name == "replace" and len(args) >= 3:
            text, old, new = (str(a) for a in args[:3])
            count = text.count(old) if old else len(text) + 1
            self._refuse_big("replace", len(text) + count * len(new))
        if name == "join" and isinstance(receiver, str) and len(args) >= 2:
            separator, items = receiver, args[1]
        elif name == "join" and args:  # the filter: value|join(d)
            separator, items = str(args[1] if len(args) > 1 else kwargs.get("d", "")), args[0]
        else:
            return
        if isinstance(items, list | tuple | str | range):
            self._refuse_big("join", len(separator) * len(items))

    def _bounded_filter(self, func: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(func)  # keeps jinja_pass_arg (pass_context, pass_environment...)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self._check_arguments(func, args, kwargs)
            result = func(*args, **kwargs)
            if isinstance(result, str):
                self._refuse_big(f"filter {func.__name__}", len(result))
            return result

        return bounded

    def call(
        __self,  # jinja's own signature: the names must not clash with the call's kwargs
        __context: Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        budget = __context.get(_BUDGET_NAME)
        if isinstance(budget, _Budget):
            budget.charge()
        __self._check_arguments(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        both_ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            for sequence, times in ((left, right), (right, left)):
                if _size(sequence) and isinstance(times, int):
                    self._refuse_big("repetition", _size(sequence) * times)
            if both_ints and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                raise TemplateLimitError("chat template multiplies integers too large")
        elif operator == "**":
            if (
                both_ints
                and abs(left) > 1
                and left.bit_length() * min(right, 2**20) > _MAX_INT_BITS
            ):
                raise TemplateLimitError("chat template raises an integer to a huge power")
        elif operator == "+":
            self._refuse_big("concatenation", _size(left) + _size(right))
        elif operator == "%" and isinstance(left, str) and _HUGE_FORMAT_WIDTH.search(left):
            raise TemplateLimitError("chat template format string has a huge width")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=32)
def compile_template(source: str, limits: TemplateLimits = TemplateLimits()) -> jinja2.Template:
    """Compiles once per distinct template text; compiling costs far more than rendering."""
    env = _BoundedEnvironment(limits)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template does not compile: {error}") from error


def select_template(raw: object, name: str | None = None) -> str | None:
    """Picks one template from tokenizer_config's `chat_template` (a string or named list)."""
    if raw is None or isinstance(raw, str):
        if name not in (None, "default") and raw is not None:
            raise ChatTemplateError(f"no chat template named {name!r}; only a default exists")
        return raw
    if isinstance(raw, list):
        templates = {
            entry["name"]: entry["template"]
            for entry in raw
            if isinstance(entry, dict) and "name" in entry and "template" in entry
        }
        wanted = name or "default"
        if wanted not in templates:
            raise ChatTemplateError(
                f"no chat template named {wanted!r}; available: {sorted(templates)}"
            )
        return templates[wanted]
    raise ChatTemplateError(f"chat_template must be a string or a list, got {type(raw).__name__}")


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str | None],
    extra: Mapping[str, Any] | None = None,
    limits: TemplateLimits | None = None,
) -> str:
    """Renders `messages` with the variables transformers passes, within `limits`. Any template
    failure (syntax, `raise_exception`, a limit, an exception its code raised) is a
    ChatTemplateError carrying the template's message."""
    variables: dict[str, Any] = dict(special_tokens)
    variables.update(extra or {})
    variables["messages"] = [dict(message) for message in messages]
    variables["add_generation_prompt"] = add_generation_prompt
    limits = limits or TemplateLimits()
    budget = _Budget(limits)
    variables.update(
        {
            _BUDGET_NAME: budget,
            _STEPS_NAME: budget.counted,
            _JOIN_NAME: budget.join,
            "range": budget.range,
        }
    )
    try:
        template = compile_template(source, limits)
        return template.render(**variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template failed to render: {error}") from error
    except RecursionError as error:
        raise ChatTemplateError("chat template failed to render: it recursed too deep") from error
    except MemoryError as error:
        raise TemplateLimitError("chat template ran out of memory while rendering") from error
    except Exception as error:
        # The template's own code failed: its fault, not the server's.
        raise ChatTemplateError(
            f"chat template failed to render: {type(error).__name__}: {error}"
        ) from error


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja template, or the template itself (as vLLM); a
    value naming no file and without template syntax is taken for a mistyped path."""
    try:
        is_file = Path(value).expanduser().is_file()
    except OSError:  # a template is no file name (too long, say)
        is_file = False
    if is_file:
        return Path(value).expanduser().read_text()
    if any(mark in value for mark in ("{{", "{%", "\n")):
        return value
    raise ChatTemplateError(
        f"--chat-template {value!r}: no such file, and not a Jinja template either"
    )
