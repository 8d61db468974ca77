"""Bounded chat template rendering: real templates render exactly as transformers renders them,
and hostile ones (nested loops, huge ranges, strings or numbers, deep recursion, failing code)
fail fast with a ChatTemplateError naming what went wrong, instead of holding a thread for
minutes or allocating gigabytes."""

from __future__ import annotations

import time

import pytest
from transformers.utils.chat_template_utils import _compile_jinja_template

from nori.sampling.chat_template import (
    ChatTemplateError,
    TemplateLimitError,
    TemplateLimits,
    render_chat_template,
)

SPECIAL_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there, héllo"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]

# SmolLM2-Instruct's template (ChatML, with a default system prompt).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The parts of Llama 3.1's template that use the most of Jinja: namespace-free system message
# split, strftime_now, tojson with indent, trim, slicing, raise_exception, loop controls.
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception("Only user and assistant roles are supported!") }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if loop.index0 > 100 %}{%- break %}{%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
{{- "turns=" ~ ns.turns ~ " " ~ strftime_now("%Y")|length }}"""

HOSTILE = {
    "nested loops": (
        "{% for i in range(1500) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "nested loops over data": (
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "a huge range": ("{% for i in range(1000000) %}{% endfor %}", "range"),
    "string repetition": ("{{ 'a' * 1000000000 }}", "repetition"),
    "a padding filter": ("{{ 'a'|center(1000000000) }}", "center"),
    "a padding method": ("{{ 'a'.ljust(1000000000) }}", "ljust"),
    "a padding format": ("{{ '%0999999999d' % 1 }}", "huge width"),
    "a huge power": ("{{ 10 ** 100000000 }}", "power"),
    "doubling in a namespace": (
        "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "than",
    ),
    "a huge join": ("{{ range(100000)|join('x' * 100000) }}", "join"),
    "a huge replace": ("{{ ('x' * 10000)|replace('', 'y' * 10000) }}", "replace"),
    "exponential macro calls": (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}"
        "{{ f(40) }}",
        "",
    ),
    "endless recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed"),
    "long output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "longer"),
    "division by zero": ("{{ 1/0 }}", "ZeroDivisionError"),
    "an undefined call": ("{{ foo.bar() }}", "'foo' is undefined"),
    "a syntax error": ("{% for %}", "does not compile"),
    "raise_exception": ("{{ raise_exception('no tools here') }}", "no tools here"),
    "a reserved name": ("{% set _nori_steps = 1 %}", "reserved"),
    "reaching the budget": ("{{ _nori_budget.charge() }}", "unsafe"),
    "a bad int()": ("{{ 'x' | int + none }}", "TypeError"),
}


def _render(source: str, limits: TemplateLimits | None = None, **extra: object) -> str:
    return render_chat_template(
        source, MESSAGES, add_generation_prompt=True, special_tokens=SPECIAL_TOKENS,
        extra=extra, limits=limits,
    )  # fmt: skip


@pytest.mark.parametrize("source", [SMOLLM2_TEMPLATE, LLAMA31_TEMPLATE], ids=["smollm2", "llama"])
@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f"}}]])
def test_real_templates_render_as_transformers_renders_them(source: str, tools: object) -> None:
    expected = _compile_jinja_template(source).render(
        messages=MESSAGES, add_generation_prompt=True, tools=tools, **SPECIAL_TOKENS
    )
    assert _render(source, tools=tools) == expected
    assert "<|" in expected


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_fail_fast_with_a_clear_message(name: str) -> None:
    source, fragment = HOSTILE[name]
    started = time.monotonic()
    with pytest.raises(ChatTemplateError) as raised:
        _render(source)
    assert time.monotonic() - started < TemplateLimits.timeout_s + 0.5
    assert fragment in str(raised.value)


def test_the_limits_are_the_ones_given() -> None:
    loop = "{% for i in range(n) %}{{ i % 10 }}{% endfor %}"
    assert len(_render(loop, TemplateLimits(max_steps=1000), n=900)) == 900
    with pytest.raises(TemplateLimitError, match="more than 1000 steps"):
        _render(loop, TemplateLimits(max_steps=1000), n=1000)
    with pytest.raises(TemplateLimitError, match="longer than 500 characters"):
        _render(
            "{% for i in range(n) %}ab{% endfor %}", TemplateLimits(max_output_chars=500), n=450
        )
    busy = "{% for i in range(200000) %}{% for c in 'abcdefghij' %}{% endfor %}{% endfor %}"
    started = time.monotonic()
    with pytest.raises(TemplateLimitError, match=r"more than 0\.05 s"):
        _render(busy, TemplateLimits(max_steps=10**9, timeout_s=0.05))
    assert time.monotonic() - started < 0.5
